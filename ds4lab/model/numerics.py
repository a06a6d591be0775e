"""The rounding simulations that are part of the DS4 model (docs/MODEL.md, "Numerics").

Written once over an array namespace ``xp`` (numpy or mlx.core). Each rounding is "scale by a power of
two, snap to the nearest representable value with ties to the even code, scale back"; the snapping is
a round-half-even of ``value / quantum`` where the quantum is the spacing of the code grid at that
magnitude, which picks the even code on ties because the code index and the quotient share parity.
"""

from __future__ import annotations

FP8_MAX = 448.0
FP8_AMAX_FLOOR = 1e-4
FP8_BLOCK = 64
FP4_MAX = 6.0
FP4_AMAX_FLOOR = 7.052966104933725e-38
FP4_BLOCK = 32


def f16_round(xp, x):
    """Round to IEEE half (nearest even) and back, as ds4 stores every KV row."""
    return x.astype(xp.float16).astype(x.dtype)


def _pow2_ceil_log2(xp, v):
    return xp.power(2.0, xp.ceil(xp.log2(v))).astype(v.dtype)


def e4m3_round(xp, a):
    """Nearest FP8 E4M3FN value to ``a`` in [0, 448]: 3 mantissa bits, subnormals below 2^-6."""
    e = xp.floor(xp.log2(xp.maximum(a, 2.0 ** -6)))
    quantum = xp.power(2.0, e - 3).astype(a.dtype)
    return xp.round(a / quantum) * quantum


def e2m1_round(xp, a):
    """Nearest FP4 E2M1 value to ``a`` in [0, 6]: the grid 0, .5, 1, 1.5, 2, 3, 4, 6."""
    quantum = xp.where(a < 2.0, 0.5, xp.where(a < 4.0, 1.0, 2.0)).astype(a.dtype)
    return xp.round(a / quantum) * quantum


def fp8_kv_sim(xp, x, n_rot: int):
    """FP8 E4M3 round trip of the non-RoPE dims of KV rows, per 64-block with a power-of-two scale
    (docs/MODEL.md, "Numerics")."""
    d = x.shape[-1]
    n_nope = d - n_rot
    head = x[..., :n_nope].reshape(*x.shape[:-1], n_nope // FP8_BLOCK, FP8_BLOCK)
    amax = xp.maximum(xp.abs(head).max(axis=-1, keepdims=True), FP8_AMAX_FLOOR)
    scale = _pow2_ceil_log2(xp, amax / FP8_MAX)
    v = xp.clip(head / scale, -FP8_MAX, FP8_MAX)
    q = xp.sign(v) * e4m3_round(xp, xp.abs(v)) * scale
    return xp.concatenate([q.reshape(*x.shape[:-1], n_nope), x[..., n_nope:]], axis=-1)


def hadamard(xp, x):
    """Natural-order Walsh–Hadamard transform of the last axis (a power of two), scaled by 1/sqrt(n)."""
    n = x.shape[-1]
    lead = x.shape[:-1]
    stride = 1
    while stride < n:
        pairs = x.reshape(*lead, n // (2 * stride), 2, stride)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = xp.stack([a + b, a - b], axis=-2).reshape(*lead, n)
        stride *= 2
    return x * (1.0 / n ** 0.5)


def fp4_sim(xp, x):
    """FP4 E2M1 round trip per 32-block with a power-of-two scale (docs/MODEL.md, "Numerics")."""
    lead, n = x.shape[:-1], x.shape[-1]
    blocks = x.reshape(*lead, n // FP4_BLOCK, FP4_BLOCK)
    amax = xp.maximum(xp.abs(blocks).max(axis=-1, keepdims=True), FP4_AMAX_FLOOR)
    scale = _pow2_ceil_log2(xp, amax / FP4_MAX)
    v = xp.clip(xp.abs(blocks) / scale, 0.0, FP4_MAX)
    return (xp.sign(blocks) * e2m1_round(xp, v) * scale).reshape(*lead, n)


def hadamard_fp4_sim(xp, x):
    """The indexer's quantization-aware step on q and on compressed indexer rows (docs/MODEL.md, "Numerics")."""
    return fp4_sim(xp, hadamard(xp, x))
