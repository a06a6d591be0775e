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

    def __init__(self, kernels: bool = True, chunk_operands: str = "float32", decode_matmul: str = "float32"):
        from ..mlx_kernels.cpu import CpuKernels

        if (chunk_operands != "float32" or decode_matmul != "float32") and not kernels:
            raise ValueError(f"chunk_operands={chunk_operands!r} (prefill_matmul), decode_matmul={decode_matmul!r}: "
                             f"reduced products need the kernels")
        self.decode_matmul = decode_matmul
        self.kernels = CpuKernels() if kernels else None
        if kernels:
            self.kernels.chunk_operands = chunk_operands
            self.kernels.decode_matmul = decode_matmul

    def branch(self):
        """In order, checking at every launch what a GPU's side stream would need (:class:`CheckedBranch`)."""
        from ..mlx_kernels.cpu import CheckedBranch

        return CheckedBranch(self.kernels)
