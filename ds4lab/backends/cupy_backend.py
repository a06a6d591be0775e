"""The CuPy backend (float32 on an NVIDIA GPU).

Weights stay on the GPU in their GGUF block form and run through ds4lab's kernels (``kernels=True``,
the default); the routed experts of a layer are uploaded whole, once, and a step evaluates its selected
experts in one launch per projection (qmatmul for a decode step, qgemm for a chunk). With kernels, the
layers of a decode step (up to ``compiled_rows`` tokens) are captured as one CUDA graph, or per layer
half where tiers split them, and replayed (see :mod:`ds4lab.cuda.graphs`); ``Transformer(compile=False)``
launches them op by op. ``upload`` sends a step's small host arrays in one transfer. ``kernels=False``
is the plain-ops path: every weight dequantized to float32 on the GPU and every op a CuPy array op.
"""

from __future__ import annotations

import cupy as cp
import numpy as np

from .kernel_ops import BlockBackend
from .packing import pack, views


class CupyBackend(BlockBackend):
    name = "cupy"
    xp = cp
    dtype = cp.float32

    def __init__(self, device: str | int | None = None, kernels: bool = True, chunk_tf32: bool = False):
        index = 0 if device in (None, "gpu", "cuda") else int(str(device).removeprefix("cuda:"))
        if not 0 <= index < cp.cuda.runtime.getDeviceCount():
            raise ValueError(f"CUDA device {device!r} does not exist here ({cp.cuda.runtime.getDeviceCount()} GPUs)")
        self.cuda_device = cp.cuda.Device(index)
        self.cuda_device.use()
        self.device = f"cuda:{index}"
        self.use_kernels = kernels
        self.chunk_tf32 = chunk_tf32  # prefill_matmul="tf32" (see ds4lab.load)
        self._kernels: dict[int, object] = {}  # CUDA modules are per device: one set per GPU used (tiers)

    compiled_rows = 16  # a chunk of more rows runs eagerly: its launches are few against its GPU time
    compiles_ffn = True  # decode routing stays on the device, so the FFN half is a graph too

    @property
    def can_compile(self) -> bool:
        return self.use_kernels

    def compile(self, fn):
        from ..cuda.graphs import GraphStep

        return GraphStep(fn)

    def upload(self, arrays):
        """One host-to-device transfer for all of them (a decode step's tables, positions and ids)."""
        host = [np.asarray(a, dtype=np.float32 if a.dtype.kind == "f" else np.int32) for a in arrays]
        buf, offs = pack(host)
        return views(cp.asarray(buf), host, offs)

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

            self._kernels[index] = CudaKernels(self.chunk_tf32)
        return self._kernels[index]

    def to_numpy(self, x):
        return cp.asnumpy(x)

    def synchronize(self):
        cp.cuda.get_current_stream().synchronize()
