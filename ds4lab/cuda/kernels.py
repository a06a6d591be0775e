"""The CuPy launcher: the same kernel bodies as MLX's, compiled by NVRTC once per process and device, one
module per kernel, in parallel threads (NVRTC releases the GIL: a fresh machine's compile takes about the
longest kernel's time instead of the sum). CuPy keeps each compiled module in its on-disk kernel cache,
so later processes start warm."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import cupy as cp
import numpy as np
from cupy._core import _routines_linalg as cublas_types  # CuPy's switch of cuBLAS's compute type
from cupy_backends.cuda.api import runtime
from cupy_backends.cuda.libs import cublas

from ..mlx_kernels import specs as S
from ..mlx_kernels.dialects import cuda_module_source
from ..mlx_kernels.launches import ArrayLaunches
from . import driver
from .branches import open_branches


def _compiled(spec, device_id: int):
    with cp.cuda.Device(device_id):
        module = cp.RawModule(code=cuda_module_source([spec]), options=("--std=c++17",))
        return module.get_function(spec.name)


@lru_cache(maxsize=None)
def _functions(device_id: int) -> dict:
    """{kernel name: CuPy function} for every kernel of :func:`specs.all_specs`, on ``device_id``."""
    specs = S.all_specs()
    with ThreadPoolExecutor(max_workers=min(len(specs), os.cpu_count() or 1)) as pool:
        return dict(zip((s.name for s in specs), pool.map(lambda s: _compiled(s, device_id), specs)))


def _aligned16(x):
    """``x``, copied where its start is not 16-byte aligned: qmatmul and qgemm read rows 16 bytes at a time."""
    return x if x.data.ptr % 16 == 0 else x.copy()


class CudaKernels(ArrayLaunches):
    """Kernel launches on the current CuPy device."""

    xp = cp

    def __init__(self, chunk_operands: str = "float32", decode_matmul: str = "float32"):
        self.device_id = cp.cuda.Device().id
        self._functions = _functions(self.device_id)
        self.chunk_operands = chunk_operands
        self.decode_matmul = decode_matmul
        super().__init__()

    def _array(self, a):
        """A host array kept on the device (a launch constant, a plan). While a branch is open the upload, queued on
        the current stream, is waited for: another stream may read the constant first (:mod:`.branches`)."""
        out = cp.asarray(a)
        if open_branches():
            cp.cuda.get_current_stream().synchronize()
        return out

    def dense_product(self, x, w):
        """cuBLAS in float32; on the tensor cores in TF32 with ``chunk_operands`` "tf32" (the compute type CuPy
        passes to cuBLAS, set for this product only), on half operands with "f16" (see :meth:`_half_gemm`; few
        output rows stay float32: :meth:`_product_operands`)."""
        operands = self._product_operands(w.shape[0])
        if operands == "f16":
            return self._half_gemm(x[:, None, :], w[None])
        if operands == "float32":
            return x @ w.T
        if operands != "tf32":
            raise ValueError(f"unknown chunk_operands {operands!r}; choose one of {', '.join(S.OPERANDS)}")
        before = cublas_types.get_compute_type(cp.float32)
        cublas_types.set_compute_type(cp.float32, cublas_types.COMPUTE_TYPE_TF32)
        try:
            return x @ w.T
        finally:
            cublas_types.set_compute_type(cp.float32, before)

    def batched_dense_product(self, x, w):
        """One strided batched cuBLAS GEMM (TF32 with ``chunk_operands`` "tf32", half operands with "f16") that
        reads each group's rows of ``x`` in place (its rows may be spaced wider than G·K) and writes ``[T, G·N]``
        directly: no copy of x's groups and no concatenation of their products."""
        if self.chunk_operands == "f16":
            return self._half_gemm(x, w)
        T, G, K = x.shape
        if x.strides[1:] != (4 * K, 4) or x.strides[0] < 4 * G * K or x.dtype != cp.float32:
            x = cp.ascontiguousarray(x, dtype=cp.float32)
        w = cp.ascontiguousarray(w, dtype=cp.float32)
        compute = cublas.CUBLAS_COMPUTE_32F_FAST_TF32 if self.chunk_operands == "tf32" else cublas.CUBLAS_COMPUTE_32F
        return self._strided_gemm(x, w, runtime.CUDA_R_32F, x.strides[0] // 4, compute)

    def _half_gemm(self, x, w):
        """``out[t, g] = x[t, g] @ w[g]ᵀ`` on operands rounded to half (to nearest even), products summed in
        float32 (cuBLAS, compute type 32F): the operands' 10 mantissa bits of TF32. x's half copy is made here
        (round_half), and w's unless it is dequantized as halves already (:meth:`chunk_weight`)."""
        x16, w16 = self._f16(x), self._f16(w)
        return self._strided_gemm(x16, w16, runtime.CUDA_R_16F, x.shape[1] * x.shape[2], cublas.CUBLAS_COMPUTE_32F)

    @staticmethod
    def _strided_gemm(x, w, dtype, x_row: int, compute):
        """``[T, G·N]`` from ``x [T, G, K]`` (rows ``x_row`` elements apart, each group's K contiguous) and ``w
        [G, N, K]`` (contiguous), both of cuBLAS type ``dtype``, through one strided batched GEMM."""
        T, G, K = x.shape
        N = w.shape[1]
        out = cp.empty((T, G * N), dtype=cp.float32)
        handle = cp.cuda.device.get_cublas_handle()
        cublas.setStream(handle, cp.cuda.get_current_stream().ptr)
        one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)
        # column-major: out_gᵀ [N, T] (ld G·N) = w_g [K, N]ᵀ (ld K) · x_gᵀ [K, T] (ld = x's row stride)
        cublas.gemmStridedBatchedEx(
            handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, N, T, K, one.ctypes.data,
            w.data.ptr, dtype, K, N * K, x.data.ptr, dtype, x_row, K,
            zero.ctypes.data, out.data.ptr, runtime.CUDA_R_32F, G * N, N, G, compute, cublas.CUBLAS_GEMM_DEFAULT)
        return out

    def _f32(self, x):
        return _aligned16(super()._f32(x))

    def _f16(self, x):
        return _aligned16(super()._f16(x))

    def _launch(self, spec, groups, threads, args):
        driver.launch(self._functions[spec.name], groups, threads, args)
