"""The kernels of :mod:`ds4lab.mlx_kernels` compiled for CuPy (one ``RawModule`` per kernel) and their launchers."""

from .ops import CudaKernels

__all__ = ["CudaKernels"]
