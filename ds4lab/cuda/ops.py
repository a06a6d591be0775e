"""The CuPy launcher: the same kernel bodies as MLX's, compiled by NVRTC once per process and device, one
module per kernel, in parallel threads (NVRTC releases the GIL: a fresh machine's compile takes about the
longest kernel's time instead of the sum). CuPy keeps each compiled module in its on-disk kernel cache,
so later processes start warm."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import cupy as cp
from cupy._core import _routines_linalg as cublas_types  # CuPy's switch of cuBLAS's compute type

from ..mlx_kernels import specs as S
from ..mlx_kernels.dialects import cuda_module_source
from ..mlx_kernels.launches import ArrayLaunches


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


class CudaKernels(ArrayLaunches):
    """Kernel launches on the current CuPy device."""

    xp = cp

    def __init__(self, chunk_tf32: bool = False):
        self.device_id = cp.cuda.Device().id
        self._functions = _functions(self.device_id)
        self.chunk_tf32 = chunk_tf32
        super().__init__()

    def dense_product(self, x, w):
        """cuBLAS in float32; with ``chunk_tf32`` on the tensor cores in TF32 (the compute type CuPy passes to
        cuBLAS, set for this product only)."""
        if not self.chunk_tf32:
            return x @ w.T
        before = cublas_types.get_compute_type(cp.float32)
        cublas_types.set_compute_type(cp.float32, cublas_types.COMPUTE_TYPE_TF32)
        try:
            return x @ w.T
        finally:
            cublas_types.set_compute_type(cp.float32, before)

    def _f32(self, x):
        x = super()._f32(x)
        return x if x.data.ptr % 16 == 0 else x.copy()  # qmatmul reads rows of x 16 bytes at a time

    def _launch(self, spec, groups, threads, args):
        self._functions[spec.name](groups, (threads,), args)
