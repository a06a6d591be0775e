"""NumPy float32 with ds4lab's GPU kernels executed by the CPU emulator (:mod:`ds4lab.mlx_kernels.cpu`):
the same block-form linears, gathered experts and fused ops as the GPU backends, on any machine with a
C++20 compiler. It exists to test the kernels and their wiring on CPUs; it is slow."""

from __future__ import annotations

import numpy as np

from .base import BlockBackend


class EmulatedBackend(BlockBackend):
    name = "emulated"
    xp = np
    dtype = np.float32
    device = "cpu (emulated GPU kernels)"

    def __init__(self, kernels: bool = True, chunk_tf32: bool = False):
        from ..mlx_kernels.cpu import CpuKernels

        if chunk_tf32 and not kernels:
            raise ValueError("chunk_tf32 (prefill_matmul='tf32') needs the kernels")
        self.kernels = CpuKernels() if kernels else None
        if chunk_tf32:
            self.kernels.chunk_tf32 = True
