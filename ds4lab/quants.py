"""GGML block quant formats used by DeepSeek V4 Flash files (docs/FORMATS.md, "GGUF model files").

``dequantize`` decodes rows of F32, F16, BF16, Q8_0, Q2_K, Q4_K, IQ2_XXS, MXFP4 (and I32) with that section's
formulas, left to right in float32; that is also gguf's order, so the results match its decoders bit
for bit, and it is the reference the GPU kernels mirror. ``quantize`` covers
the types test models are written in directly; ``random_blocks`` makes seeded, valid K/IQ/Q8_0/MXFP4 blocks
for test weights, since there is no Python quantizer for the K and IQ types.

Arrays of quantized data are ``uint8`` with the last axis holding one row's bytes.
"""

from __future__ import annotations

from typing import Callable

import gguf.quants
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

_Blocks = np.ndarray  # (n_blocks, type_size) uint8 -> (n_blocks, block_size) values


def row_bytes(qtype: Q | int, ne0: int) -> int:
    """Bytes in one row of ``ne0`` elements of ``qtype``."""
    qt = Q(qtype)
    block, type_size = GGML_QUANT_SIZES[qt]
    if ne0 <= 0 or ne0 % block:
        raise ValueError(f"{qt.name}: row length ne0={ne0} is not a positive multiple of the block size {block}")
    return ne0 // block * type_size


def _f16(blocks: _Blocks, offset: int) -> np.ndarray:
    """The f16 field at byte ``offset`` of each block, as float32 of shape (n_blocks, 1)."""
    return np.ascontiguousarray(blocks[:, offset:offset + 2]).view("<f2").astype(np.float32)


def _dequant_f32(b: _Blocks) -> np.ndarray:
    return b.view("<f4").astype(np.float32)


def _dequant_f16(b: _Blocks) -> np.ndarray:
    return b.view("<f2").astype(np.float32)


def _dequant_bf16(b: _Blocks) -> np.ndarray:
    return (b.view("<u2").astype(np.uint32) << 16).view(np.float32)


def _dequant_i32(b: _Blocks) -> np.ndarray:
    return b.view("<i4").astype(np.int32)


def _dequant_q8_0(b: _Blocks) -> np.ndarray:
    return _f16(b, 0) * b[:, 2:].view(np.int8).astype(np.float32)


_Q2_SHIFTS = (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1, 1)


def _dequant_q2_k(b: _Blocks) -> np.ndarray:
    # Axes (n, h, j, s, l) give element e = 128h + 32j + 16s + l.
    n = len(b)
    sc = b[:, 0:16].reshape(n, 2, 4, 2, 1)
    qs = b[:, 16:80].reshape(n, 2, 1, 2, 16)
    d = _f16(b, 80).reshape(n, 1, 1, 1, 1)
    dmin = _f16(b, 82).reshape(n, 1, 1, 1, 1)
    q = (qs >> _Q2_SHIFTS) & 3
    x = d * (sc & 15) * q - dmin * (sc >> 4)
    return x.reshape(n, 256)


def _q4_k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack the 12 scale bytes into eight 6-bit (scale, min) pairs, one per sub-block
    (docs/FORMATS.md, "GGUF model files")."""
    lo, mid, hi = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    s = np.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=1)
    m = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return s, m


def _dequant_q4_k(b: _Blocks) -> np.ndarray:
    # Sub-block 2c takes the low nibbles of qs[32c:32c+32], sub-block 2c+1 the high ones.
    n = len(b)
    d, dmin = _f16(b, 0)[:, :, None], _f16(b, 2)[:, :, None]
    s, m = _q4_k_scale_min(b[:, 4:16])
    q = (b[:, 16:144].reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15
    x = d * s[:, :, None] * q.reshape(n, 8, 32) - dmin * m[:, :, None]
    return x.reshape(n, 256)


def _iq2xxs_grid() -> np.ndarray:
    """ggml's ``iq2xxs_grid`` as (256, 8) bytes: entry i, byte j = (grid[i] >> 8j) & 255."""
    gguf.quants.IQ2_XXS.init_grid()
    return gguf.quants.IQ2_XXS.grid.reshape(256, 8).astype(np.uint8)


def _ksigns_iq2xs() -> np.ndarray:
    i = np.arange(128, dtype=np.uint8)
    parity = np.unpackbits(i[:, None], axis=1).sum(axis=1, dtype=np.uint8) & 1
    return i | (parity << 7)


_IQ2XXS_GRID = _iq2xxs_grid()
_KSIGNS = _ksigns_iq2xs()


def iq2xxs_tables() -> np.ndarray:
    """The IQ2_XXS lookup tables as one byte array for kernels: the grid (256 × 8), then the 128 signs."""
    return np.concatenate([_IQ2XXS_GRID.reshape(-1), _KSIGNS])

_IQ2_SIGN_SHIFTS = np.array([0, 7, 14, 21], dtype=np.uint32)
_BIT_SHIFTS = np.arange(8, dtype=np.uint8)


def _dequant_iq2_xxs(b: _Blocks) -> np.ndarray:
    # Each 32-element sub-block is 8 bytes: a0 (four grid indices) then a1 (4 x 7 sign bits, 4-bit scale).
    n = len(b)
    sub = b[:, 2:].reshape(n, 8, 8)
    a1 = np.ascontiguousarray(sub[:, :, 4:]).view("<u4")[:, :, 0]
    scale = _f16(b, 0) * (np.float32(0.5) + (a1 >> 28).astype(np.float32)) * np.float32(0.25)
    grid = _IQ2XXS_GRID[sub[:, :, :4]]
    signs = _KSIGNS[(a1[:, :, None] >> _IQ2_SIGN_SHIFTS) & 127]
    sign = np.where((signs[..., None] >> _BIT_SHIFTS) & 1, np.float32(-1), np.float32(1))
    x = scale[:, :, None, None] * grid * sign
    return x.reshape(n, 256)


# MXFP4 (the OCP microscaling format of DeepSeek V4's own routed experts): a byte e, the block's power-of-two scale,
# then 16 bytes of 4-bit E2M1 codes, element j < 16 in the low nibble of byte j and element 16 + j in its high one.
# Code c is sign (bit 3) and magnitude MXFP4_DOUBLED[c & 7] / 2; the scale is 2^(e − 127) (e = 0 read as 2^−127,
# as ds4 does). Both are kept as ggml does: the doubled integer times half the scale, 2^(e − 128), the same exact
# product but for code 8 (+0) and e = 255 (docs/FORMATS.md, "GGUF model files").
MXFP4_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12)


def mxfp4_half_scale(e: np.ndarray) -> np.ndarray:
    """2^(e − 128) as float32 bits for E8M0 bytes ``e`` (e < 2 are subnormal floats: 2^−128 and 2^−127)."""
    e = e.astype(np.uint32)
    return np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23)).astype(np.uint32).view(np.float32)


_MXFP4_VALUES = np.array([*MXFP4_DOUBLED, *(-v for v in MXFP4_DOUBLED)], dtype=np.float32)


def _dequant_mxfp4(b: _Blocks) -> np.ndarray:
    codes = np.concatenate([b[:, 1:17] & 15, b[:, 1:17] >> 4], axis=1)
    return mxfp4_half_scale(b[:, :1]) * _MXFP4_VALUES[codes]


_DEQUANT: dict[Q, Callable[[_Blocks], np.ndarray]] = {
    Q.F32: _dequant_f32,
    Q.F16: _dequant_f16,
    Q.BF16: _dequant_bf16,
    Q.I32: _dequant_i32,
    Q.Q8_0: _dequant_q8_0,
    Q.Q2_K: _dequant_q2_k,
    Q.Q4_K: _dequant_q4_k,
    Q.IQ2_XXS: _dequant_iq2_xxs,
    Q.MXFP4: _dequant_mxfp4,
}

SUPPORTED: frozenset[Q] = frozenset(_DEQUANT)


def dequantize(raw: np.ndarray, qtype: Q | int, ne0: int) -> np.ndarray:
    """Decode rows of ``qtype``: uint8 ``(..., row_bytes)`` -> float32 (int32 for I32) ``(..., ne0)``."""
    qt = Q(qtype)
    decode = _DEQUANT.get(qt)
    if decode is None:
        raise ValueError(f"dequantize: unsupported quant type {qt.name}")
    nbytes = row_bytes(qt, ne0)
    if raw.dtype != np.uint8 or raw.ndim == 0 or raw.shape[-1] != nbytes:
        raise ValueError(
            f"dequantize {qt.name}: a row of {ne0} elements is {nbytes} uint8 bytes, "
            f"got an array of {raw.dtype} with shape {raw.shape}"
        )
    blocks = np.ascontiguousarray(raw).reshape(-1, GGML_QUANT_SIZES[qt][1])
    return decode(blocks).reshape(raw.shape[:-1] + (ne0,))


_QUANTIZABLE = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.MXFP4})


def quantize(x: np.ndarray, qtype: Q | int) -> np.ndarray:
    """Encode ``x`` (last axis = row) as uint8 rows of ``qtype``; F32, F16, BF16, Q8_0 and MXFP4 only."""
    qt = Q(qtype)
    if qt not in _QUANTIZABLE:
        raise ValueError(f"quantize: unsupported quant type {qt.name}")
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0:
        raise ValueError("quantize: x needs at least one axis (the row)")
    row_bytes(qt, x.shape[-1])  # validates the row length
    if qt == Q.F32:
        return np.ascontiguousarray(x, dtype="<f4").view(np.uint8)
    if qt == Q.F16:
        return np.ascontiguousarray(x, dtype="<f2").view(np.uint8)
    # gguf's BF16 (round to nearest even), Q8_0 and MXFP4 match ggml bit for bit.
    return gguf.quants.quantize(x, qt)


# decode_matmul="q8": the block of x quantized for a weight type's decode products (ds4.c's CPU path, and its CUDA
# back-end's dp4a products in ds4_cuda.cu: Q8_0 activations for Q8_0 weights, Q8_K for the routed experts' IQ2_XXS
# and Q2_K).
ACTIVATION_BLOCK = {Q.Q8_0: 32, Q.IQ2_XXS: 256, Q.Q2_K: 256}


def quantized_activations(x: np.ndarray, qtype: Q | int) -> np.ndarray:
    """``x`` (float32, last axis a row) as a decode product on ``qtype`` weights sees it with ``decode_matmul="q8"``:
    each block of the row (:data:`ACTIVATION_BLOCK`) rounded to ``d·q``, q int8, in float64. Q8_0's blocks of 32:
    ``d = amax / 127``, ``q = rint(x · (1 / d))``; Q8_K's of 256: m the block's first element of largest |x|,
    ``scale = -127 / m``, ``q = rint(scale·x)``, ``d = 1 / scale``; each step in float32, rint half to even (ds4.c's
    order: a product by the inverse, not a division). A block whose largest |x| is below about 4e-37 (1 / d
    overflows) is not an activation's and gives non-finite values here."""
    qt = Q(qtype)
    if qt not in ACTIVATION_BLOCK:
        raise ValueError(f"quantized_activations: no activation block for {qt.name} weights")
    x = np.asarray(x, dtype=np.float32)
    size = ACTIVATION_BLOCK[qt]
    if x.shape[-1] % size:
        raise ValueError(f"quantized_activations: rows of {x.shape[-1]} elements are not blocks of {size}")
    b = x.reshape(-1, size)
    with np.errstate(divide="ignore"):
        if qt == Q.Q8_0:
            d = np.abs(b).max(axis=1, keepdims=True) / np.float32(127)
            scale = np.where(d != 0, np.float32(1) / d, np.float32(0))
        else:
            m = np.take_along_axis(b, np.abs(b).argmax(axis=1)[:, None], axis=1)
            scale = np.where(m != 0, np.float32(-127) / m, np.float32(0))
            d = np.where(m != 0, np.float32(1) / scale, np.float32(0))
    q = np.rint(b * scale)  # float32 products; np.rint rounds half to even
    return (d.astype(np.float64) * q).reshape(x.shape)


# Standard deviation of the dequantized values, in units of the block scale d, for the distributions
# random_blocks draws (derivations in the generators).
_Q8_0_UNIT_STD = float(np.sqrt((255**2 - 1) / 12))  # uniform integers in [-127, 127]
_Q2_K_UNIT_STD = 10.0
_Q4_K_UNIT_STD = 168.5
# IQ2_XXS: scale = d (n + 0.5) / 4 with n uniform in 0..15, times a grid byte of the table.
# MXFP4: the 16 codes uniform, in units of half the scale.
_MXFP4_UNIT_STD = float(np.sqrt(np.mean(_MXFP4_VALUES.astype(np.float64) ** 2)))
_IQ2_XXS_UNIT_STD = float(np.sqrt(np.mean((np.arange(16) + 0.5) ** 2) / 16 * np.mean(_IQ2XXS_GRID ** 2.0)))


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    """(n,) values -> (n, 2) little-endian f16 bytes; refuse scales that f16 cannot hold."""
    h = values.astype("<f2")
    if not np.all(np.isfinite(h) & (h > 0)):
        raise ValueError(f"random_blocks: block scales {values.min():.3g}..{values.max():.3g} do not fit in f16")
    return h.reshape(-1, 1).view(np.uint8)


def _block_scales(rng: np.random.Generator, n: int, std: float, unit_std: float) -> np.ndarray:
    # +-20% jitter so blocks do not all share one scale; it raises the std by only ~0.7%.
    return std / unit_std * rng.uniform(0.8, 1.2, size=n)


def _random_q8_0(rng: np.random.Generator, n: int, std: float) -> np.ndarray:
    d = _f16_bytes(_block_scales(rng, n, std, _Q8_0_UNIT_STD))
    qs = rng.integers(-127, 128, size=(n, 32), dtype=np.int8).view(np.uint8)
    return np.concatenate([d, qs], axis=1)


def _random_q2_k(rng: np.random.Generator, n: int, std: float) -> np.ndarray:
    # Scale nibble a uniform in 0..15, q uniform in 0..3 (mean 1.5, var 1.25). With dmin = 2d and the
    # min nibble ~ 0.75a (+-1), each sub-block is centred, and std^2 ~ d^2 (E[a^2] 1.25 + ~3) = (10 d)^2.
    a = rng.integers(0, 16, size=(n, 16), dtype=np.uint8)
    mins = np.clip(np.rint(0.75 * a) + rng.integers(-1, 2, size=(n, 16)), 0, 15).astype(np.uint8)
    qs = rng.integers(0, 256, size=(n, 64), dtype=np.uint8)
    d = _block_scales(rng, n, std, _Q2_K_UNIT_STD)
    return np.concatenate([a | (mins << 4), qs, _f16_bytes(d), _f16_bytes(2 * d)], axis=1)


def _pack_q4_k_scales(s: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Inverse of ``_q4_k_scale_min``: eight 6-bit scales and mins -> 12 bytes."""
    lo = (s[:, :4] & 63) | ((s[:, 4:] >> 4) << 6)
    mid = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    hi = (s[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return np.concatenate([lo, mid, hi], axis=1)


def _random_q4_k(rng: np.random.Generator, n: int, std: float) -> np.ndarray:
    # Scale s uniform in 0..63, q uniform in 0..15 (mean 7.5, var 21.25). With dmin = 8d and the min
    # ~ 0.9375s (+-1), each sub-block is centred, and std^2 ~ d^2 (E[s^2] 21.25 + ~48) = (168.5 d)^2.
    s = rng.integers(0, 64, size=(n, 8), dtype=np.uint8)
    m = np.clip(np.rint(0.9375 * s) + rng.integers(-1, 2, size=(n, 8)), 0, 63).astype(np.uint8)
    qs = rng.integers(0, 256, size=(n, 128), dtype=np.uint8)
    d = _block_scales(rng, n, std, _Q4_K_UNIT_STD)
    return np.concatenate([_f16_bytes(d), _f16_bytes(8 * d), _pack_q4_k_scales(s, m), qs], axis=1)


def _random_iq2_xxs(rng: np.random.Generator, n: int, std: float) -> np.ndarray:
    # Every byte pattern is a valid IQ2_XXS block; ksigns' parity bit makes each sign a fair coin,
    # so the mean is zero and std^2 = E[scale^2] E[grid^2].
    d = _f16_bytes(_block_scales(rng, n, std, _IQ2_XXS_UNIT_STD))
    qs = rng.integers(0, 256, size=(n, 64), dtype=np.uint8)
    return np.concatenate([d, qs], axis=1)


def _random_mxfp4(rng: np.random.Generator, n: int, std: float) -> np.ndarray:
    # Any byte pattern is a block. The scale is a power of two: with log2 of the wanted one n + f, blocks take 2^n or,
    # with odds p = (4^f − 1) / 3, 2^(n + 1), so E[scale²] is the wanted one's square (4^n (1 + 3p) = 4^(n + f)).
    n_f = np.log2(std / _MXFP4_UNIT_STD)
    up = rng.uniform(0, 1, size=n) < (4 ** (n_f - np.floor(n_f)) - 1) / 3
    e = np.floor(n_f) + 128 + up
    if not np.all((e >= 2) & (e <= 252)):  # past 252 the largest code, 12 · 2^(e − 128), overflows float32
        raise ValueError(f"random_blocks: std {std:.3g} needs MXFP4 scales outside 2^-126 .. 2^124")
    qs = rng.integers(0, 256, size=(n, 16), dtype=np.uint8)
    return np.concatenate([e.astype(np.uint8)[:, None], qs], axis=1)


_RANDOM: dict[Q, Callable[[np.random.Generator, int, float], np.ndarray]] = {
    Q.Q8_0: _random_q8_0,
    Q.Q2_K: _random_q2_k,
    Q.Q4_K: _random_q4_k,
    Q.IQ2_XXS: _random_iq2_xxs,
    Q.MXFP4: _random_mxfp4,
}


def random_blocks(
    qtype: Q | int, shape_rows: tuple[int, ...], ne0: int, rng: np.random.Generator, std: float
) -> np.ndarray:
    """Seeded random valid rows of ``qtype``, shape ``shape_rows + (row_bytes,)``, whose dequantized
    values have mean ~0 and standard deviation ~``std``."""
    qt = Q(qtype)
    generate = _RANDOM.get(qt)
    if generate is None:
        raise ValueError(f"random_blocks: unsupported quant type {qt.name}")
    nbytes = row_bytes(qt, ne0)
    if not std > 0:
        raise ValueError(f"random_blocks: std must be positive, got {std}")
    n_rows = int(np.prod(shape_rows, dtype=np.int64))
    blocks = generate(rng, n_rows * nbytes // GGML_QUANT_SIZES[qt][1], std)
    return blocks.reshape(tuple(shape_rows) + (nbytes,))
