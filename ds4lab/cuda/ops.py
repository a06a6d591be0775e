"""The CuPy launcher: the same kernel bodies as MLX's, compiled by NVRTC once per process and device, one
module per kernel, in parallel threads (NVRTC releases the GIL: a fresh machine's compile takes about the
longest kernel's time instead of the sum). CuPy keeps each compiled module in its on-disk kernel cache,
so later processes start warm."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import cupy as cp

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

    def __init__(self):
        self.device_id = cp.cuda.Device().id
        self._functions = _functions(self.device_id)
        super().__init__()

    def _f32(self, x):
        x = super()._f32(x)
        return x if x.data.ptr % 16 == 0 else x.copy()  # qmatmul reads rows of x 16 bytes at a time

    def _launch(self, spec, groups, threads, args):
        self._functions[spec.name](groups, (threads,), args)
