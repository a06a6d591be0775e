"""The MLX backend (float32): CPU, Metal, or CUDA with mlx[cuda].

On a GPU (Metal, or CUDA with mlx[cuda]) ds4lab's kernels are on by default (``kernels=False`` turns
them off): every weight stays on the device in its GGUF block form (Q8_0's as tiles) and runs through the same kernels,
launch for launch, as on CuPy (:class:`ds4lab.backends.block_weights.BlockLinear`); routed experts stay
whole on the device, decode-sized attention uses the split-key kernel and a chunk's attention attend_chunk.
On MLX's CUDA back-end the weights are copied into the GPU's own memory (:func:`ds4lab.mlx_kernels.fast.resident`).

Without kernels (the CPU) Q8_0 weights stay quantized: a Q8_0 block ``x = d·q`` (int8 q) is exactly MLX's
8-bit affine form ``x = d·(q+128) − 128·d`` with group size 32, so ``mx.quantized_matmul`` runs on the
GGUF blocks without a float copy of the matrix; the other types are dequantized to float32 (F16 kept as halves).

Making the backend sets ``MLX_ENABLE_TF32``'s default to "0" (:func:`float32_gemms`).
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as Q

from ..quants import dequantize
from .base import Backend

Q8_0_BLOCK_BYTES = 34


def _q8_0_affine(raw: np.ndarray, ne0: int):
    blocks = raw.reshape(raw.shape[0], ne0 // 32, Q8_0_BLOCK_BYTES)
    d = np.ascontiguousarray(blocks[:, :, :2]).view(np.float16)[..., 0].astype(np.float32)
    q = blocks[:, :, 2:].view(np.int8).astype(np.int16) + 128
    packed = np.ascontiguousarray(q.astype(np.uint8).reshape(raw.shape[0], ne0)).view(np.uint32)
    return mx.array(packed), mx.array(d), mx.array(-128.0 * d)


def float32_gemms() -> None:
    """Keep MLX's float32 GEMMs at float32 precision, unless the user chose otherwise.

    ds4lab's math is float32 (docs/MODEL.md, "Numerics"); MLX runs float32 GEMMs at TF32 precision on CUDA
    (and on M5-class Apple GPUs) unless ``MLX_ENABLE_TF32`` is "0", far from float32's accuracy (the error
    measured on the H200: benchmarks/README.md). MLX reads the variable at its first GEMM, so this sets its
    default before any: when the backend is made, before its first product, and in code that makes the
    kernels' launchers (:class:`ds4lab.mlx_kernels.fast.MLXKernels`, whose dense products are GEMMs) without
    the backend. An explicit ``MLX_ENABLE_TF32`` set by the user wins."""
    os.environ.setdefault("MLX_ENABLE_TF32", "0")


class MLXBackend(Backend):
    name = "mlx"
    xp = mx
    np_dtype = np.float32
    dtype = mx.float32

    def __init__(self, device: str | None = None, kernels: bool | None = None):
        float32_gemms()
        if device is not None:
            if device not in ("cpu", "gpu"):
                raise ValueError(f"unknown MLX device {device!r}; use 'cpu' or 'gpu'")
            mx.set_default_device(mx.cpu if device == "cpu" else mx.gpu)
        self._device = mx.default_device()  # kept: a later load for another device sets the process's default
        self.device = str(self._device)
        on_gpu = self._device == mx.gpu
        self._cuda = on_gpu and not mx.metal.is_available()  # MLX's CUDA back-end
        if kernels and not on_gpu:
            raise ValueError("MLX kernels need the GPU device (device='gpu')")
        if kernels is None:
            kernels = on_gpu
        self._rope_tables: dict = {}  # (RopeParams, device) -> the tables on the device (rope_rows)
        if kernels:
            from ..mlx_kernels.fast import MLXKernels

            self._kernels = MLXKernels()
        else:
            self._kernels = None

    @property
    def kernels(self):
        """ds4lab's kernels while the current device is theirs; None on a "cpu" tier of a GPU model,
        whose layers run the plain ops (MLX's custom kernels exist only on GPUs)."""
        k = self._kernels
        return k if k is not None and mx.default_device() == k.device else None

    def scope(self):
        return mx.stream(self._device)

    @property
    def gathers_rope_rows(self) -> bool:
        # On MLX's CUDA back-end a host array is a managed buffer that returns to MLX's cache when freed, where a
        # later op's output of its size may land and fault (docs/GPU.md): a step uploads only its positions.
        return self._cuda and self.kernels is not None

    def rope_rows(self, params, positions, on_device):
        cos, sin = params.kept(int(np.max(positions)) + 1)
        key = (params, self.device_key())
        kept = self._rope_tables.get(key)
        if kept is None or len(kept[0]) != len(cos):  # new, or the host's tables doubled
            kept = self._rope_tables[key] = (self.constant(cos), self.constant(sin))
        cos_d, sin_d = kept
        return mx.take(cos_d, on_device, axis=0), mx.take(sin_d, on_device, axis=0)

    def device_key(self):
        # With kernels, a GPU tier keeps block-form linears and a cpu tier float ones: one copy each.
        return None if self._kernels is None else str(mx.default_device())

    def asarray(self, a):
        return mx.array(np.asarray(a, dtype=np.float32))

    def to_numpy(self, x):
        return np.array(x)

    def linear(self, raw, qtype, ne0: int):
        blocks = self.block_linear(raw, qtype, ne0)  # with kernels: the CuPy path's linears, launch for launch
        if blocks is not None:
            return blocks
        if qtype == Q.Q8_0:
            w, scales, biases = _q8_0_affine(raw, ne0)
            return lambda x: mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=32, bits=8)
        if qtype == Q.F16:
            weight = mx.array(dequantize(raw, qtype, ne0).astype(np.float16))
            return lambda x: x @ weight.astype(mx.float32).T
        weight_t = mx.array(dequantize(raw, qtype, ne0)).T
        return lambda x: x @ weight_t

    def constant(self, a):
        a = np.asarray(a, dtype=np.float32) if a.dtype.kind == "f" else a
        return mx.array(a) if self.kernels is None else self.kernels._array(a)  # on CUDA in the GPU's own memory

    device_bytes = constant

    def index_add(self, acc, rows, values):
        return acc.at[mx.array(rows)].add(values)

    @property
    def can_compile(self) -> bool:
        # Tracing is slow and the compiled step gains little on the CPU, so only GPUs compile by default
        # (Runtime(..., compile=True) forces it).
        return mx.default_device() == mx.gpu

    @property
    def compiled_rows(self) -> float:
        # Every chunk size compiles (the last chunk padded to the step), but on MLX's CUDA back-end only a decode
        # step of one token, each size being a trace: tracing put the full-width Flash slice's first 2048-token
        # chunk minutes past a 10 s cold-start target (benchmarks/README.md), while a decode step's Python ran
        # longer than its kernels.
        return 1 if self._cuda else float("inf")

    @property
    def compiles_ffn(self) -> bool:
        # with the kernels a decode step routes its experts on the device (a chunk picks them on the host)
        return self.kernels is not None

    def compile(self, fn, carry=None, family=None):
        compiled = mx.compile(fn)  # MLX's arrays are never written in place: the carried state is new arrays
        return lambda *args, live=None, written=None: compiled(*args)  # new arrays whole: no rows to leave out

    def eval(self, *xs):
        mx.eval(*xs)
