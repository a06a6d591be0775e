"""Quant formats (docs/FORMATS.md, "GGUF model files"): our decoders against gguf's and against hand-worked blocks."""

from __future__ import annotations

import gguf.quants
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from ds4lab import quants
from ds4lab.quants import SUPPORTED, dequantize, quantize, random_blocks, row_bytes

BLOCK_TYPES = [Q.Q8_0, Q.Q2_K, Q.Q4_K, Q.IQ2_XXS, Q.MXFP4]
# Byte offsets of the f16 fields (d, dmin) inside one block; MXFP4's scale is a byte (E8M0 at 0).
F16_FIELDS = {Q.Q8_0: [0], Q.Q2_K: [80, 82], Q.Q4_K: [0, 2], Q.IQ2_XXS: [0], Q.MXFP4: []}


def f16(v: float) -> list[int]:
    return list(np.array([v], "<f2").view(np.uint8))


def block_size(qtype: Q) -> int:
    return gguf.GGML_QUANT_SIZES[qtype][0]


# --- against gguf's numpy decoders --------------------------------------------------------------------


def random_bytes_with_finite_scales(qtype: Q, rng: np.random.Generator, shape_rows: tuple[int, ...], ne0: int):
    """Uniform random bytes (every quant/scale byte pattern is valid) with finite, signed f16 d/dmin."""
    nbytes = row_bytes(qtype, ne0)
    type_size = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, size=shape_rows + (nbytes,), dtype=np.uint8)
    blocks = raw.reshape(-1, type_size)
    for off in F16_FIELDS[qtype]:
        scales = (rng.standard_normal(len(blocks)) * 0.1).astype("<f2")
        blocks[:, off:off + 2] = scales.reshape(-1, 1).view(np.uint8)
    if qtype == Q.MXFP4:  # exponents up to 250 (past 252 the largest code overflows float32), subnormal 0 and 1 too
        blocks[:, 0] = rng.integers(0, 251, size=len(blocks))
        blocks[:4, 0] = [0, 1, 2, 250]
    return raw


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf_bit_exactly(qtype: Q):
    # Same float32 operations in the same order as gguf's numpy code, so equality is exact.
    rng = np.random.default_rng(1234)
    ne0 = 3 * block_size(qtype) if qtype != Q.Q8_0 else 3 * 32 * 8
    for raw in (
        random_bytes_with_finite_scales(qtype, rng, (4, 5), ne0),
        random_blocks(qtype, (4, 5), ne0, rng, std=0.05),
    ):
        ours = dequantize(raw, qtype, ne0)
        assert ours.dtype == np.float32 and ours.shape == (4, 5, ne0)
        np.testing.assert_array_equal(ours, gguf.quants.dequantize(raw, qtype))
        # Non-contiguous input decodes the same rows.
        np.testing.assert_array_equal(dequantize(raw[:, ::2], qtype, ne0), ours[:, ::2])


# --- hand-worked single blocks ------------------------------------------------------------------------


def test_q8_0_hand_block():
    # d = 0.5 (f16 0x3800), x_i = d * qs[i]: -128 -> -64, 0 -> 0, 1 -> 0.5, 127 -> 63.5, -3 -> -1.5.
    qs = np.array([-128, 0, 1, 127] + [-3] * 28, np.int8)
    raw = np.array(f16(0.5) + list(qs.view(np.uint8)), np.uint8)
    expected = np.array([-64.0, 0.0, 0.5, 63.5] + [-1.5] * 28, np.float32)
    np.testing.assert_array_equal(dequantize(raw, Q.Q8_0, 32), expected)
    np.testing.assert_array_equal(dequantize(raw, 8, 32), expected)  # plain type id works too


def test_q2_k_hand_block():
    # e = 128h + 32j + 16s + l; sc = scales[8h+2j+s]; q = (qs[32h+16s+l] >> 2j) & 3
    # x = d (sc & 15) q - dmin (sc >> 4), with d = 0.25, dmin = 0.5.
    scales = np.zeros(16, np.uint8)
    qs = np.zeros(64, np.uint8)
    scales[13] = 0x3A  # h=1, j=2, s=1: sc&15 = 10, sc>>4 = 3 -> elements 208..223
    scales[15] = 0x21  # h=1, j=3, s=1: sc&15 = 1,  sc>>4 = 2 -> elements 240..255
    qs[53] = 0xB4  # 32h+16s+l with h=1, s=1, l=5; 0b10_11_01_00 -> q = 0, 1, 3, 2 for j = 0..3
    raw = np.concatenate([scales, qs, f16(0.25), f16(0.5)]).astype(np.uint8)
    expected = np.zeros(256, np.float32)
    expected[208:224] = -1.5  # q = 0: -0.5 * 3
    expected[213] = 6.0  # e = 128+64+16+5, q = 3: 0.25*10*3 - 0.5*3 = 7.5 - 1.5
    expected[240:256] = -1.0  # q = 0: -0.5 * 2
    expected[245] = -0.5  # e = 128+96+16+5, q = 2: 0.25*1*2 - 0.5*2 = 0.5 - 1
    # Elements 149 (j=0, q=0) and 181 (j=1, q=1) read qs[53] too, but their sc byte is 0 -> 0.
    np.testing.assert_array_equal(dequantize(raw, Q.Q2_K, 256), expected)


def test_q4_k_hand_block():
    # Sub-blocks 1 (j<4) and 5 (j>=4) share scale bytes 1, 5 and 9; d = 0.5, dmin = 0.25.
    #   sm(1) = (scales[1] & 63, scales[5] & 63) = (0xC5 & 63, 0x87 & 63) = (5, 7)
    #   sm(5) = ((scales[9] & 15) | (scales[1] >> 6) << 4, (scales[9] >> 4) | (scales[5] >> 6) << 4)
    #         = (0xA | 3 << 4, 0x4 | 2 << 4) = (58, 36)
    scales = np.zeros(12, np.uint8)
    scales[1], scales[5], scales[9] = 0xC5, 0x87, 0x4A
    qs = np.zeros(128, np.uint8)
    qs[3] = 0x9C  # c=0, l=3: low 12 -> element 3 (sub-block 0, scale 0), high 9 -> element 35 (sub-block 1)
    qs[67] = 0xF0  # c=2, l=3: low 0 -> element 131 (sub-block 4), high 15 -> element 163 (sub-block 5)
    raw = np.concatenate([f16(0.5), f16(0.25), scales, qs]).astype(np.uint8)
    expected = np.zeros(256, np.float32)
    expected[32:64] = -1.75  # q = 0: -0.25 * 7
    expected[35] = 20.75  # 0.5*5*9 - 0.25*7 = 22.5 - 1.75
    expected[160:192] = -9.0  # q = 0: -0.25 * 36
    expected[163] = 426.0  # 0.5*58*15 - 0.25*36 = 435 - 9
    np.testing.assert_array_equal(dequantize(raw, Q.Q4_K, 256), expected)


def test_iq2_xxs_hand_block():
    # d = 1. Sub-block 1: a0 = grid indices [1, 2, 0, 0]; a1 = 3 | 1 << 7 | 3 << 28 (0x30000083):
    #   scale = 1 * (0.5 + 3) * 0.25 = 0.875
    #   grid[1] = 0x080808080808082b -> [43, 8, 8, 8, 8, 8, 8, 8]; signs ksigns[3] = 0x03 (bits 0, 1)
    #   grid[2] = 0x0808080808081919 -> [25, 25, 8, 8, 8, 8, 8, 8]; signs ksigns[1] = 0x81 (bits 0, 7)
    #   grid[0] = all 8, no signs -> 7.0
    # The other sub-blocks are all-zero bytes: grid[0], scale 1 * 0.5 * 0.25 = 0.125 -> 1.0.
    qs = np.zeros(64, np.uint8)
    qs[8:16] = [1, 2, 0, 0, 0x83, 0x00, 0x00, 0x30]
    raw = np.concatenate([f16(1.0), qs]).astype(np.uint8)
    expected = np.ones(256, np.float32)
    expected[32:40] = [-37.625, -7, 7, 7, 7, 7, 7, 7]
    expected[40:48] = [-21.875, 21.875, 7, 7, 7, 7, 7, -7]
    expected[48:64] = 7.0
    np.testing.assert_array_equal(dequantize(raw, Q.IQ2_XXS, 256), expected)


def test_mxfp4_hand_block():
    # ds4.c's rule (its ds4_e8m0_to_f32 and E2M1 table), written out: scale 2^(e − 127), e = 0 read as 2^−127; code c
    # is ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}[c & 7], negative with bit 3; element j < 16 the low nibble of byte j, 16 + j
    # the high one.
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    qs = np.array([j | (15 - j) << 4 for j in range(16)], np.uint8)  # low nibble j, high 15 − j
    for e, scale in ((126, 0.5), (130, 8.0), (127, 1.0), (0, 2.0**-127), (1, 2.0**-126), (250, 2.0**123)):
        raw = np.concatenate([[e], qs]).astype(np.uint8)
        expected = np.array([scale * e2m1[j] for j in range(16)] + [scale * e2m1[15 - j] for j in range(16)],
                            np.float32)
        np.testing.assert_array_equal(dequantize(raw, Q.MXFP4, 32), expected, err_msg=f"e = {e}")
    half_scales = quants.mxfp4_half_scale(np.array([0, 1, 2, 128], np.uint8)).tolist()
    assert half_scales == [2.0**-128, 2.0**-127, 2.0**-126, 1.0]


def test_mxfp4_quantize_round_trips_its_own_grid():
    # Values already on a block's grid (a power-of-two scale times E2M1 magnitudes, the largest 6·scale) come back
    # exactly; gguf's quantizer picks the scale from the block's largest |x|.
    rng = np.random.default_rng(11)
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    scale = np.float32(2.0) ** rng.integers(-6, 6, size=(8, 2))
    x = rng.choice(e2m1, size=(8, 64)) * scale.repeat(32, axis=1)
    x[:, 0], x[:, 32] = 6 * scale[:, 0], -6 * scale[:, 1]  # each block's largest |x|: 6·scale
    raw = quantize(x, Q.MXFP4)
    assert raw.dtype == np.uint8 and raw.shape == (8, row_bytes(Q.MXFP4, 64)) == (8, 34)
    np.testing.assert_array_equal(dequantize(raw, Q.MXFP4, 64), x)


def test_iq2_xxs_tables_match_ggml():
    # ksigns derived from the formula in docs/FORMATS.md, "GGUF model files", vs the literal ggml table that gguf
    # carries.
    assert quants._KSIGNS.tobytes() == gguf.quants.IQ2_XXS.ksigns
    grid = quants._IQ2XXS_GRID
    assert grid.shape == (256, 8) and set(np.unique(grid)) == {8, 25, 43}
    as_u64 = grid.astype(np.uint64) << (8 * np.arange(8, dtype=np.uint64))
    assert [int(v) for v in as_u64[:3].sum(axis=1)] == [0x0808080808080808, 0x080808080808082B, 0x0808080808081919]


# --- float types, quantize, I32 -----------------------------------------------------------------------


def test_f32_f16_bf16_round_trips():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 4, 64)).astype(np.float32)
    np.testing.assert_array_equal(dequantize(quantize(x, Q.F32), Q.F32, 64), x)
    assert quantize(x, Q.F32).shape == (3, 4, 256)
    assert quantize(x, Q.F16).shape == quantize(x, Q.BF16).shape == (3, 4, 128)

    np.testing.assert_array_equal(dequantize(quantize(x, Q.F16), Q.F16, 64), x.astype(np.float16).astype(np.float32))
    x16 = x.astype(np.float16).astype(np.float32)  # representable values come back unchanged
    np.testing.assert_array_equal(dequantize(quantize(x16, Q.F16), Q.F16, 64), x16)

    xb = (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)  # exact bf16 values
    np.testing.assert_array_equal(dequantize(quantize(xb, Q.BF16), Q.BF16, 64), xb)
    # BF16 rounds to nearest even: 1 + 2^-8 is halfway to 1 + 2^-7 -> 1; 1 + 3*2^-8 -> 1 + 2^-6.
    ties = np.array([1 + 2**-8, 1 + 3 * 2**-8, -2.0], np.float32)
    np.testing.assert_array_equal(dequantize(quantize(ties, Q.BF16), Q.BF16, 3), [1.0, 1 + 2**-6, -2.0])


def test_q8_0_quantize_error_bound():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((16, 256)) * rng.uniform(0.01, 10, (16, 1))).astype(np.float32)
    raw = quantize(x, Q.Q8_0)
    assert raw.dtype == np.uint8 and raw.shape == (16, row_bytes(Q.Q8_0, 256))
    err = np.abs(dequantize(raw, Q.Q8_0, 256) - x).reshape(16, 8, 32)
    # qs = round(x / d) with d = amax / 127, so |x - d qs| <= d/2; the stored scale is f16(d), which
    # adds |qs| * |d - f16(d)| <= 127 |d - f16(d)|.
    d = np.abs(x).reshape(16, 8, 32).max(axis=-1, keepdims=True) / 127
    d16 = raw.reshape(16, 8, 34)[:, :, :2].copy().view("<f2").astype(np.float32)
    assert np.all(err <= d / 2 + 127 * np.abs(d - d16) + 1e-6 * d)
    # A block whose scale is exact in f16 (amax = 63.5 -> d = 0.5) meets d/2 itself.
    x = np.linspace(-63.5, 63.5, 32, dtype=np.float32)
    assert np.abs(dequantize(quantize(x, Q.Q8_0), Q.Q8_0, 32) - x).max() <= 0.25


def test_i32():
    v = np.array([[0, 1, -1, 2**31 - 1], [-(2**31), 7, 255, 256]], np.int32)
    out = dequantize(v.view(np.uint8), Q.I32, 4)
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, v)


def test_supported_set():
    assert SUPPORTED == {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q2_K, Q.Q4_K, Q.IQ2_XXS, Q.MXFP4, Q.I32}


# --- random_blocks --------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_random_blocks_deterministic_and_scaled(qtype: Q):
    ne0 = 512
    a = random_blocks(qtype, (2, 3), ne0, np.random.default_rng(5), std=0.02)
    b = random_blocks(qtype, (2, 3), ne0, np.random.default_rng(5), std=0.02)
    c = random_blocks(qtype, (2, 3), ne0, np.random.default_rng(6), std=0.02)
    assert a.dtype == np.uint8 and a.shape == (2, 3, row_bytes(qtype, ne0))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)

    for std in (0.02, 1.0, 30.0):
        x = dequantize(random_blocks(qtype, (64,), 4096, np.random.default_rng(9), std), qtype, 4096)
        assert np.all(np.isfinite(x))
        assert abs(x.mean()) < 0.05 * std
        assert 0.9 < x.std() / std < 1.1


def test_random_blocks_rejects_unrepresentable_std():
    with pytest.raises(ValueError, match="do not fit in f16"):
        random_blocks(Q.Q4_K, (1,), 256, np.random.default_rng(0), std=1e-9)
    with pytest.raises(ValueError, match="MXFP4 scales outside"):
        random_blocks(Q.MXFP4, (1,), 32, np.random.default_rng(0), std=1e-60)
    with pytest.raises(ValueError, match="std must be positive"):
        random_blocks(Q.Q8_0, (1,), 32, np.random.default_rng(0), std=0.0)


# --- bad inputs -----------------------------------------------------------------------------------------


def test_row_bytes():
    assert row_bytes(Q.Q8_0, 64) == 68
    assert row_bytes(Q.Q2_K, 512) == 168
    assert row_bytes(Q.Q4_K, 256) == 144
    assert row_bytes(Q.IQ2_XXS, 256) == 66
    assert row_bytes(Q.MXFP4, 2048) == 1088
    assert row_bytes(Q.BF16, 3) == 6
    with pytest.raises(ValueError, match=r"Q4_K: row length ne0=100 .* block size 256"):
        row_bytes(Q.Q4_K, 100)
    with pytest.raises(ValueError, match=r"Q8_0: row length ne0=0"):
        row_bytes(Q.Q8_0, 0)


def test_bad_inputs():
    raw = np.zeros((2, 34), np.uint8)
    with pytest.raises(ValueError, match=r"IQ2_XXS: row length ne0=32 .* block size 256"):
        dequantize(raw, Q.IQ2_XXS, 32)
    with pytest.raises(ValueError, match=r"Q8_0: a row of 64 elements is 68 uint8 bytes, .* shape \(2, 34\)"):
        dequantize(raw, Q.Q8_0, 64)
    with pytest.raises(ValueError, match=r"got an array of float32"):
        dequantize(raw.astype(np.float32), Q.Q8_0, 32)
    with pytest.raises(ValueError, match="dequantize: unsupported quant type Q5_K"):
        dequantize(np.zeros(176, np.uint8), Q.Q5_K, 256)
    with pytest.raises(ValueError, match="quantize: unsupported quant type Q4_K"):
        quantize(np.zeros(256, np.float32), Q.Q4_K)
    with pytest.raises(ValueError, match="random_blocks: unsupported quant type F16"):
        random_blocks(Q.F16, (1,), 32, np.random.default_rng(0), std=1.0)
    with pytest.raises(ValueError, match=r"Q8_0: row length ne0=33"):
        quantize(np.zeros(33, np.float32), Q.Q8_0)
    with pytest.raises(ValueError):
        dequantize(raw, 12345, 32)  # not a GGML type id
