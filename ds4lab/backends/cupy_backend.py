"""The CuPy backend (float32 on an NVIDIA GPU).

Weights stay on the GPU in their GGUF block form and run through ds4lab's kernels (``kernels=True``,
the default); the routed experts of a layer are uploaded whole, once, and a decode step evaluates its
selected experts in one launch per projection. ``kernels=False`` is the plain-ops path: every weight
dequantized to float32 on the GPU and every op a CuPy array op.
"""

from __future__ import annotations

import cupy as cp
import numpy as np
from gguf import GGMLQuantizationType as Q

from ..quants import dequantize
from .kernel_ops import BlockLinear, KernelOps, StackedBlockLinear, kernel_types


class CupyBackend(KernelOps):
    name = "cupy"
    xp = cp
    np_dtype = np.float32
    dtype = cp.float32
    can_compile = False

    def __init__(self, device: str | int | None = None, kernels: bool = True):
        index = 0 if device in (None, "gpu", "cuda") else int(str(device).removeprefix("cuda:"))
        if not 0 <= index < cp.cuda.runtime.getDeviceCount():
            raise ValueError(f"CUDA device {device!r} does not exist here ({cp.cuda.runtime.getDeviceCount()} GPUs)")
        self.cuda_device = cp.cuda.Device(index)
        self.cuda_device.use()
        self.device = f"cuda:{index}"
        self.use_kernels = kernels
        self._kernels: dict[int, object] = {}  # CUDA modules are per device: one set per GPU used (tiers)

    def device_key(self):
        return cp.cuda.Device().id

    @property
    def kernels(self):
        """The kernels of the current CUDA device, or None when they are switched off."""
        if not self.use_kernels:
            return None
        index = cp.cuda.Device().id
        if index not in self._kernels:
            from ..cuda import CudaKernels

            self._kernels[index] = CudaKernels()
        return self._kernels[index]

    def asarray(self, a):
        return cp.asarray(np.asarray(a, dtype=np.float32))

    def to_numpy(self, x):
        return cp.asnumpy(x)

    def linear(self, raw, qtype, ne0: int):
        qtype = Q(qtype)
        if self.kernels is None or qtype not in kernel_types():
            weight_t = cp.asarray(dequantize(raw, qtype, ne0)).T
            return lambda x: x @ weight_t
        if qtype == Q.F32:  # already floats: the bytes are the matrix
            weight_t = cp.asarray(raw).view(cp.float32).reshape(raw.shape[0], ne0).T
            return lambda x: x @ weight_t
        return BlockLinear(self.kernels, cp.asarray(raw), qtype, ne0, raw.shape[0])

    def stacked_linear(self, raw, qtype, ne0: int) -> StackedBlockLinear | None:
        """Every expert of ``raw [n_expert, rows, row_bytes]`` in block form on the GPU (None: no kernel)."""
        if self.kernels is None or Q(qtype) not in kernel_types():
            return None
        return StackedBlockLinear(self.kernels, cp.asarray(raw), qtype, ne0, raw.shape[1])

    def index_add(self, acc, rows, values):
        acc[cp.asarray(rows)] += values  # rows are distinct
        return acc

    def scalar(self, v: int):
        return int(v)

    def eval(self, *xs):
        pass

    def synchronize(self):
        cp.cuda.get_current_stream().synchronize()
