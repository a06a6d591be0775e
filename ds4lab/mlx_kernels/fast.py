"""The kernels' launchers for MLX's GPU back-ends (MLX's ``mx.fast`` custom kernels), both built from the
same bodies: on CUDA the cubins of :mod:`.nvrtc` through ``mx.fast.precompiled_cuda_kernel``, on Apple GPUs
``mx.fast.metal_kernel``. MLX's ``grid`` counts threads, not groups.

Importing this module changes nothing in the process. MLX's float32 GEMMs (the launchers' dense products
among them) keep float32 precision on CUDA only where ``MLX_ENABLE_TF32`` is "0" by the first GEMM: the MLX
backend sets that default when it is made (:func:`ds4lab.backends.mlx_backend.float32_gemms`); code that
makes :class:`MLXKernels` without the backend calls that function first."""

from __future__ import annotations

from functools import lru_cache, partial

import mlx.core as mx
import numpy as np

from . import specs as S
from .launches import KernelLaunches
from .nvrtc import cubins, device_arch


def gpu_dialect() -> str | None:
    """"cuda" or "metal" when MLX has that GPU back-end, else None."""
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return None


# MLX's CUDA allocator keeps an array of this many bytes or fewer in a pool of host pages the GPU reads across
# the bus at every access (a position, a count, a kernel's two dims): such arrays are made longer and sliced.
CUDA_SCALAR_BYTES = 8


def resident(a: np.ndarray):
    """Host array ``a`` in the GPU's own memory, on MLX's CUDA back-end. MLX keeps an array made from host data
    in CUDA managed memory (the smallest in host pages, :data:`CUDA_SCALAR_BYTES`), which the GPU's kernels
    read many times slower than the memory an op on the GPU's stream allocates: the product by one is that op,
    with the same bits. MLX's allocator reuses cached buffers by size alone, whatever memory they are in, so the
    cache is emptied before the product (its buffer a new device allocation, not a cached managed one) and after
    the managed copy is freed (no later op's output lands in it).
    Measured in benchmarks/README.md, "mlx_decode_host.py"."""
    small = a.nbytes <= CUDA_SCALAR_BYTES
    host = mx.array(np.resize(a, 2 * CUDA_SCALAR_BYTES // a.itemsize + 1) if small else a)
    mx.clear_cache()
    out = host * mx.array(1, dtype=host.dtype)
    mx.eval(out)
    del host
    mx.clear_cache()
    return out[:a.size].reshape(a.shape) if small else out


@lru_cache(maxsize=None)
def _cuda_cubins(arch: str) -> dict[str, bytes]:
    """Every kernel's cubin for ``arch``, read or compiled once per process."""
    return cubins(S.all_specs(), arch)


class MLXKernels(KernelLaunches):
    """The launches of :class:`.launches.KernelLaunches` through MLX: outputs come back from the kernel."""

    device = mx.gpu  # the MLX device the kernels run on
    xp = mx

    def __init__(self, dialect: str | None = None):
        self.dialect = dialect or gpu_dialect()
        if self.dialect is None:
            raise RuntimeError("MLX has no GPU back-end here (neither Metal nor CUDA); custom kernels need one")
        self._kernels: dict[str, object] = {}
        # MLX's Python API does not say which CUDA device its GPU is; it is device 0 unless told otherwise.
        self._cubins = _cuda_cubins(device_arch(0)) if self.dialect == "cuda" else {}
        super().__init__()

    def _kernel(self, spec):
        if spec.name not in self._kernels:
            if self.dialect == "cuda":  # MLX loads each cubin once per process, keyed by the kernel's name
                self._kernels[spec.name] = partial(mx.fast.precompiled_cuda_kernel, name=spec.name,
                                                   compiled_source=self._cubins[spec.name], scalars=[],
                                                   ensure_row_contiguous=True)
            else:
                header, source = spec.mlx_source(self.dialect)
                self._kernels[spec.name] = mx.fast.metal_kernel(
                    name=spec.name, input_names=spec.input_names, output_names=spec.output_names, source=source,
                    header=header)
        return self._kernels[spec.name]

    def _run(self, spec, groups, threads, inputs, outputs):
        if not all(isinstance(o, tuple) for o in outputs):
            raise NotImplementedError(f"{spec.name}: MLX's kernels make new outputs, none is written in place")
        return self._kernel(spec)(
            inputs=inputs, grid=(groups[0] * threads, groups[1], 1), threadgroup=(threads, 1, 1),
            output_shapes=[tuple(shape) for shape, _ in outputs],
            output_dtypes=[getattr(mx, dtype) for _, dtype in outputs])

    def _array(self, a):
        return resident(np.asarray(a)) if self.dialect == "cuda" else mx.array(a)

    def _f32(self, x):
        return x.astype(mx.float32)  # MLX makes kernel inputs row-contiguous itself

    def _f16(self, x):
        return x.astype(mx.float16)

    def _u8(self, x):
        return x.view(mx.uint8) if x.dtype == mx.bool_ else x.astype(mx.uint8)  # a bool is a byte: no copy

    def _i32(self, x):
        return mx.array([x], dtype=mx.int32) if isinstance(x, (int, np.integer)) else x.astype(mx.int32).reshape(-1)

    def _bool(self, x):
        return x.view(mx.bool_)  # the kernels' masks hold 0 or 1
