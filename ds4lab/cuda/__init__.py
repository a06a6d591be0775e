"""The kernels of :mod:`ds4lab.mlx_kernels` compiled for CuPy (one ``RawModule`` per kernel) and their launchers
(:mod:`.kernels`), and CUDA graphs of a step (:mod:`.graphs`)."""

from .kernels import CudaKernels

__all__ = ["CudaKernels"]
