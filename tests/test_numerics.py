"""FP8 E4M3, FP4 E2M1, Hadamard-128 and F16 rounding (docs/MODEL.md, "Numerics") against hand-worked values and
a brute-force nearest-code search over the full code tables, on both backends."""

import mlx.core as mx
import numpy as np
import pytest

from ds4lab.model import numerics as nx

XPS = [pytest.param(np, id="numpy"), pytest.param(mx, id="mlx")]


def to_xp(xp, a):
    return xp.array(np.asarray(a, dtype=np.float32 if xp is mx else np.float64))


def e4m3_codes():
    """The 127 non-negative E4M3FN code values, index = code (docs/MODEL.md, "Numerics")."""
    vals = []
    for i in range(127):
        e, m = i >> 3, i & 7
        vals.append(m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(vals)


E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])


def nearest_even_code(codes, a):
    """Brute force: the nearest code, ties to the even index."""
    d = np.abs(codes[None, :] - a[:, None])
    best = d.min(axis=1, keepdims=True)
    cand = d == best
    idx = np.array([np.flatnonzero(row)[0] if len(np.flatnonzero(row)) == 1 else
                    next(i for i in np.flatnonzero(row) if i % 2 == 0) for row in cand])
    return codes[idx]


@pytest.mark.parametrize("xp", XPS)
def test_e4m3_matches_brute_force_including_every_tie(xp):
    codes = e4m3_codes()
    mids = (codes[1:] + codes[:-1]) / 2  # exact ties between neighbours
    rng = np.random.default_rng(0)
    a = np.concatenate([codes, mids, rng.uniform(0, 448, 2000), rng.uniform(0, 2 ** -5, 500)])
    got = np.array(nx.e4m3_round(xp, to_xp(xp, a)))
    np.testing.assert_array_equal(got, nearest_even_code(codes, a))


def test_e4m3_hand_worked_ties():
    # 17 lies between 16 (code 0x50: e=10,m=0) and 18 (m=1): tie → even code → 16.
    # 19 lies between 18 (m=1) and 20 (m=2): tie → even code (m=2) → 20.
    # 2^-10 lies between 0 (code 0) and 2^-9 (code 1): tie → 0.
    got = nx.e4m3_round(np, np.array([17.0, 19.0, 2.0 ** -10, 3 * 2.0 ** -10, 448.0, 440.0]))
    np.testing.assert_array_equal(got, [16.0, 20.0, 0.0, 2 * 2.0 ** -9, 448.0, 448.0])


@pytest.mark.parametrize("xp", XPS)
def test_e2m1_matches_brute_force(xp):
    mids = (E2M1[1:] + E2M1[:-1]) / 2
    a = np.concatenate([E2M1, mids, np.random.default_rng(1).uniform(0, 6, 1000)])
    got = np.array(nx.e2m1_round(xp, to_xp(xp, a)))
    np.testing.assert_array_equal(got, nearest_even_code(E2M1, a))
    # hand-worked ties: 1.75 → 2 (index 4), 2.5 → 2 (index 4), 3.5 → 4 (index 6), 5 → 4 (index 6), 0.25 → 0
    np.testing.assert_array_equal(nx.e2m1_round(np, np.array([1.75, 2.5, 3.5, 5.0, 0.25, 0.75])),
                                  [2.0, 2.0, 4.0, 4.0, 0.0, 1.0])


def test_fp8_kv_sim_block_scale_and_untouched_tail():
    # One 64-block with amax 100 → scale 2^ceil(log2(100/448)) = 2^-2; values are snapped on the
    # E4M3 grid in units of the scale. The 64 RoPE dims pass through unchanged.
    x = np.zeros(128)
    x[0], x[1], x[2], x[3] = 100.0, 0.3, -17.0 * 0.25, 1e-3
    x[64:] = np.linspace(-3, 3, 64) + 1e-7
    y = nx.fp8_kv_sim(np, x, n_rot=64)
    # 100/0.25 = 400 → E4M3 grid at 256..448 has step 32: 400 is exactly 12.5 steps → tie → even (384)
    assert y[0] == 384 * 0.25
    # 0.3/0.25 = 1.2 → step 1/8 in [1,2): 1.2 = 9.6 steps → 10 → 1.25 → 0.3125
    assert y[1] == 1.25 * 0.25
    # 17 is a tie between 16 and 18 → 16, sign kept
    assert y[2] == -16 * 0.25
    # 1e-3/0.25 = 0.004 → subnormal step 2^-9 = 0.00195: 2.05 steps → 2 → 2^-8 · 0.25
    assert y[3] == 2 * 2.0 ** -9 * 0.25
    np.testing.assert_array_equal(y[64:], x[64:])


def test_fp8_amax_floor():
    x = np.zeros(128)
    x[5] = 1e-6  # amax floored at 1e-4 → scale 2^ceil(log2(1e-4/448)) = 2^-22
    y = nx.fp8_kv_sim(np, x, n_rot=64)
    scale = 2.0 ** -22
    assert y[5] == nearest_even_code(e4m3_codes(), np.array([1e-6 / scale]))[0] * scale


def test_hadamard_is_sylvester_and_orthonormal():
    n = 128
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    x = np.random.default_rng(2).normal(size=(3, n))
    np.testing.assert_allclose(nx.hadamard(np, x), x @ h.T / np.sqrt(n), rtol=0, atol=1e-12)
    np.testing.assert_allclose(nx.hadamard(np, nx.hadamard(np, x)), x, atol=1e-12)
    # the 32-wide transform (a non-power-of-four size) uses scale 1/sqrt(32)
    e0 = np.zeros(32)
    e0[0] = 1
    np.testing.assert_allclose(nx.hadamard(np, e0), np.full(32, 32 ** -0.5), atol=1e-15)


def test_fp4_sim_hand_worked():
    # block of 32 with amax 3 → scale 2^ceil(log2(0.5)) = 0.5; values/scale: 6, 2.5→2, 0.9→1, -1.3→-1.5
    x = np.zeros(32)
    x[:4] = [3.0, 1.25, 0.45, -0.65]
    np.testing.assert_array_equal(nx.fp4_sim(np, x)[:4], [3.0, 1.0, 0.5, -0.75])


def test_f16_round_nearest_even():
    # 1 + 2^-11 is halfway between 1 and 1 + 2^-10 → even mantissa → 1
    x = np.array([1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 65519.0, 1e-8])
    np.testing.assert_array_equal(nx.f16_round(np, x), [1.0, 1 + 2 * 2.0 ** -10, 65504.0, np.float16(1e-8)])
