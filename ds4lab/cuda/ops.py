"""The CuPy launcher: the same kernel bodies as MLX's, compiled once per process and device by NVRTC
(CuPy keeps the compiled module in its on-disk kernel cache, so later processes start warm)."""

from __future__ import annotations

from functools import lru_cache

import cupy as cp

from ..mlx_kernels import specs as S
from ..mlx_kernels.dialects import cuda_module_source
from ..mlx_kernels.launches import ArrayLaunches


@lru_cache(maxsize=None)
def _module(device_id: int):
    with cp.cuda.Device(device_id):
        module = cp.RawModule(code=cuda_module_source(S.all_specs()), options=("--std=c++17",))
        module.compile()
        return module


class CudaKernels(ArrayLaunches):
    """Kernel launches on the current CuPy device."""

    xp = cp

    def __init__(self):
        self.device_id = cp.cuda.Device().id
        self.module = _module(self.device_id)
        self._functions: dict[str, object] = {}
        super().__init__()

    def _f32(self, x):
        x = super()._f32(x)
        return x if x.data.ptr % 16 == 0 else x.copy()  # qmatmul reads rows of x 16 bytes at a time

    def _launch(self, spec, groups, threads, args):
        if spec.name not in self._functions:
            self._functions[spec.name] = self.module.get_function(spec.name)
        self._functions[spec.name](groups, (threads,), args)
