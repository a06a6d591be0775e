"""The formulas of docs/MODEL.md against hand-worked values and naive scalar loops written
straight from its text (independent of the vectorised model code)."""

import math

import numpy as np
import pytest

from ds4lab.backends.numpy_backend import NumpyBackend
from ds4lab.config import FLASH, NANO
from ds4lab.kv.layout import pending_state
from ds4lab.model.attention import (
    attend,
    grouped_output,
    indexer_allowed,
    indexer_scores,
    raw_visibility,
    visible_rows,
)
from ds4lab.model.compressor import compress_chunk
from ds4lab.model.functional import softplus, topk_mask
from ds4lab.model.hc import hc_head, hc_post, hc_pre, sinkhorn
from ds4lab.model.moe import route_weights, routed_experts, router_probs, select_topk, select_topk_on_device, swiglu
from ds4lab.model.rope import RopeParams, rope
from ds4lab.ops import Ops

rng = np.random.default_rng(1234)
B = NumpyBackend()


def sigmoid(z):
    return 1 / (1 + math.exp(-z))


# ---------------------------------------------------------------------------------------------- HC
def naive_hc_pre(X, fn, scale, base, eps=1e-6):
    """docs/MODEL.md, "Hyper-connections and Sinkhorn", step by step, scalar loops, one token."""
    n, E = X.shape
    flat = X.reshape(-1)
    r = 1 / math.sqrt(sum(v * v for v in flat) / len(flat) + 1e-6)
    mix = [sum(fn[k, i] * flat[i] * r for i in range(len(flat))) for k in range(fn.shape[0])]
    pre = [sigmoid(mix[i] * scale[0] + base[i]) + eps for i in range(n)]
    post = [2 * sigmoid(mix[n + i] * scale[1] + base[n + i]) for i in range(n)]
    M = [[mix[2 * n + n * r_ + c] * scale[2] + base[2 * n + n * r_ + c] for c in range(n)] for r_ in range(n)]
    for r_ in range(n):
        mx_ = max(M[r_])
        ex = [math.exp(v - mx_) for v in M[r_]]
        M[r_] = [v / sum(ex) + eps for v in ex]

    def col_norm():
        for c in range(n):
            s = sum(M[r_][c] for r_ in range(n)) + eps
            for r_ in range(n):
                M[r_][c] /= s

    def row_norm():
        for r_ in range(n):
            s = sum(M[r_]) + eps
            M[r_] = [v / s for v in M[r_]]

    col_norm()
    for _ in range(19):  # "20 iterations" = 1 column normalization + 19 (row, column) pairs
        row_norm()
        col_norm()
    x_in = [sum(pre[h] * X[h, d] for h in range(n)) for d in range(E)]
    return np.array(x_in), np.array(post), np.array(M)


def test_hc_pre_matches_spec_loops():
    n, E = 4, 8
    X = rng.normal(size=(1, n, E))
    fn = rng.normal(size=(2 * n + n * n, n * E)) * 0.3
    scale, base = rng.normal(size=3), rng.normal(size=2 * n + n * n)
    x_in, post, comb = hc_pre(Ops(NumpyBackend()), X, lambda x: x @ fn.T, scale, base, iters=20, eps=1e-6,
                              norm_eps=1e-6)
    ex, ep, em = naive_hc_pre(X[0], fn, scale, base)
    np.testing.assert_allclose(x_in[0], ex, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(post[0], ep, rtol=1e-12)
    np.testing.assert_allclose(comb[0], em, rtol=1e-12)
    # the result is (nearly) doubly stochastic: columns sum to 1 exactly after the last step
    np.testing.assert_allclose(comb[0].sum(axis=0), 1, atol=1e-5)


def test_sinkhorn_count_is_19_plus_1():
    logits = rng.normal(size=(1, 4, 4)) * 3
    eps = 1e-2  # a large eps makes every extra or missing normalization visible
    ours = sinkhorn(np, logits, 20, eps)
    m = np.exp(logits - logits.max(-1, keepdims=True))
    m = m / m.sum(-1, keepdims=True) + eps
    m = m / (m.sum(-2, keepdims=True) + eps)
    for _ in range(19):
        m = m / (m.sum(-1, keepdims=True) + eps)
        m = m / (m.sum(-2, keepdims=True) + eps)
    np.testing.assert_allclose(ours, m, rtol=1e-14)
    # Sinkhorn converges, so count errors show at small counts: iters=2 is softmax+eps, column,
    # row, column — and differs from one more (row, column) pair.
    m = np.exp(logits - logits.max(-1, keepdims=True))
    m = m / m.sum(-1, keepdims=True) + eps
    m = m / (m.sum(-2, keepdims=True) + eps)
    m = m / (m.sum(-1, keepdims=True) + eps)
    m = m / (m.sum(-2, keepdims=True) + eps)
    np.testing.assert_allclose(sinkhorn(np, logits, 2, eps), m, rtol=1e-14)
    assert np.abs(sinkhorn(np, logits, 3, eps) - m).max() > 1e-4


def test_hc_post_orientation():
    # comb[s, o]: input stream s feeds output stream o. A single 1 at (s=0, o=2) moves stream 0 to 2.
    X = np.arange(8.0).reshape(1, 4, 2)
    comb = np.zeros((1, 4, 4))
    comb[0, 0, 2] = 1.0
    post = np.array([[0.0, 1.0, 0.0, 0.0]])
    y = np.array([[10.0, 20.0]])
    out = hc_post(np, y, X, post, comb)
    np.testing.assert_array_equal(out[0], [[0, 0], [10, 20], [0, 1], [0, 0]])


def test_hc_head_is_sigmoid_weighted_sum():
    X = rng.normal(size=(1, 4, 6))
    fn = rng.normal(size=(4, 24))
    scale, base = np.array([0.7]), rng.normal(size=4)
    flat = X[0].reshape(-1)
    flat = flat / np.sqrt((flat ** 2).mean() + 1e-6)
    w = 1 / (1 + np.exp(-((fn @ flat) * 0.7 + base))) + 1e-6
    got = hc_head(Ops(NumpyBackend()), X, lambda x: x @ fn.T, scale, base, eps=1e-6, norm_eps=1e-6)
    np.testing.assert_allclose(got[0], (w[:, None] * X[0]).sum(0), rtol=1e-12)


# -------------------------------------------------------------------------------------------- RoPE
def test_yarn_corr_dims_recomputed_from_config():
    p = RopeParams.for_layer(FLASH, 2)
    assert (float(p.corr_dims()[0]), float(p.corr_dims()[1])) == (15.0, 25.0)
    # recomputed for the nano config (same n_rot/base/ctx → same dims) and a different n_rot
    q = RopeParams(n_rot=32, freq_base=160000, freq_scale=1 / 16, ext_factor=1, orig_ctx=65536, beta_fast=32,
                   beta_slow=1)
    corr = lambda b: 32 * math.log(65536 / (b * 2 * math.pi)) / (2 * math.log(160000))  # noqa: E731
    assert tuple(map(float, q.corr_dims())) == (max(0, math.floor(corr(32))), min(31, math.ceil(corr(1))))


def test_rope_layer_parameters():
    assert RopeParams.for_layer(FLASH, 0).freq_base == 10000 and RopeParams.for_layer(FLASH, 1).ext_factor == 0
    for il in (2, 3, 42):
        p = RopeParams.for_layer(FLASH, il)
        assert (p.freq_base, p.freq_scale, p.ext_factor, p.orig_ctx) == (160000, 1 / 16, 1, 65536)


def test_rope_tables_follow_yarn_ramp():
    p = RopeParams.for_layer(FLASH, 2)
    pos = 1000
    cos, sin = p.tables(np.array([pos]))
    angle = np.arctan2(sin[0].astype(np.float64), cos[0].astype(np.float64))
    for k in (0, 5, 15, 20, 25, 31):
        extrap = pos * 160000.0 ** (-2 * k / 64)
        ramp = 1 - min(1, max(0, (k - 15) / 10))
        want = extrap / 16 * (1 - ramp) + extrap * ramp
        want = math.atan2(math.sin(want), math.cos(want))
        assert abs(angle[k] - want) < 2e-4, k
    # magnitude: no YaRN mscale (exactly 1 in float32)
    np.testing.assert_allclose(cos[0] ** 2 + sin[0] ** 2, 1, atol=1e-6)


def test_rope_interleaved_and_inverse():
    D, n_rot = 128, 64
    x = rng.normal(size=(3, 2, D))
    p = RopeParams.for_layer(NANO, 0)
    pos = np.array([0, 5, 300])
    cos, sin = (t.astype(np.float64) for t in p.tables(pos))
    y = rope(np, x, cos, sin)
    np.testing.assert_array_equal(y[..., : D - n_rot], x[..., : D - n_rot])  # head dims untouched
    t, h, k = 1, 1, 3  # pair k rotates elements (2k, 2k+1) of the tail
    th = 5 * 10000.0 ** (-2 * k / 64)
    a, b = x[t, h, D - n_rot + 2 * k], x[t, h, D - n_rot + 2 * k + 1]
    np.testing.assert_allclose(y[t, h, D - n_rot + 2 * k: D - n_rot + 2 * k + 2],
                               [a * math.cos(th) - b * math.sin(th), a * math.sin(th) + b * math.cos(th)], rtol=1e-6)
    np.testing.assert_allclose(rope(np, y, cos, sin, inverse=True), x, atol=1e-12)
    np.testing.assert_array_equal(y[0], x[0])  # position 0 is the identity


def test_rope_float32_angle_recipe():
    # ds4 multiplies θ by ts = float32(base^(−2/n_rot)) once per pair in float32.
    p = RopeParams.for_layer(NANO, 0)
    cos, _ = p.tables(np.array([100000]))
    theta, ts = np.float32(100000), np.float32(10000.0 ** (-2 / 64))
    for _ in range(31):
        theta = theta * ts
    assert cos[0, 31] == np.cos(theta)


# -------------------------------------------------------------------------------------- compressor
def naive_compress_rows(kv, sc, R):
    """docs/MODEL.md, "Attention" (compressed rows), per window and channel, as loops over the full token
    history."""
    T, W = kv.shape
    D = W // 2 if R == 4 else W
    rows = []
    for w in range((T) // R):
        row = []
        for j in range(D):
            cands = []
            if R == 4:
                if w > 0:
                    cands += [(sc[(w - 1) * R + r, j], kv[(w - 1) * R + r, j]) for r in range(R)]
                cands += [(sc[w * R + r, D + j], kv[w * R + r, D + j]) for r in range(R)]
            else:
                cands = [(sc[w * R + r, j], kv[w * R + r, j]) for r in range(R)]
            m = max(s for s, _ in cands)
            z = sum(math.exp(s - m) for s, _ in cands)
            row.append(sum(math.exp(s - m) / z * v for s, v in cands))
        rows.append(row)
    return np.array(rows).reshape(-1, D)


def run_compressor(kv, sc, R, chunks, pad=0):
    """Feed the rows chunk by chunk (each padded with ``pad`` garbage rows); collect emitted rows."""
    T, W = kv.shape
    state_kv, state_sc = pending_state(B, R, W)
    rows, pos, i = {}, 0, 0
    while pos < T:
        step = chunks[i % len(chunks)] or T
        n = min(T - pos, step)
        junk = rng.normal(size=(pad, W)) * 50
        pooled, state_kv, state_sc = compress_chunk(np, state_kv, state_sc, np.concatenate([kv[pos:pos + n], junk]),
                                                    np.concatenate([sc[pos:pos + n], junk]), pos, n, R)
        for k in range(pooled.shape[0]):  # pooled[k] is window pos // R + k; keep the completed ones
            w = pos // R + k
            if w < (pos + n) // R:
                assert w not in rows
                rows[w] = pooled[k]
        pos, i = pos + n, i + 1
    return np.array([rows[w] for w in range(len(rows))]), state_kv, state_sc


@pytest.mark.parametrize("R,W,T", [(4, 6, 23), (128, 3, 300)])
@pytest.mark.parametrize("chunks", [[None], [1, 2, 5], [3], [7], [64]])
@pytest.mark.parametrize("pad", [0, 3])
def test_compressor_pooling_chunked(R, W, T, chunks, pad):
    kv, sc = rng.normal(size=(T, W)), rng.normal(size=(T, W)) * 2
    want = naive_compress_rows(kv, sc, R)
    rows, state_kv, state_sc = run_compressor(kv, sc, R, chunks, pad)
    np.testing.assert_allclose(rows.reshape(-1, want.shape[1]), want, rtol=1e-12, atol=1e-12)
    assert len(rows) == T // R
    # the pending state has ds4's layout: (previous window,) current window by slot, unused slots cleared
    c = 2 if R == 4 else 1
    cur = T // R * R
    np.testing.assert_array_equal(state_kv[(c - 1) * R:(c - 1) * R + T - cur], kv[cur:])
    np.testing.assert_array_equal(state_sc[(c - 1) * R + T - cur:], -1e30)
    np.testing.assert_array_equal(state_kv[(c - 1) * R + T - cur:], 0.0)
    if R == 4:
        np.testing.assert_array_equal(state_kv[:4], kv[cur - 4:cur])


def test_ratio4_first_window_uses_only_current_second_half():
    kv = np.zeros((4, 4))
    kv[:, 2:] = [[1, 10], [2, 20], [3, 30], [4, 40]]
    sc = np.zeros((4, 4))
    sc[:, :2] = 100.0  # first halves would dominate if window 0 looked at them
    rows, _, _ = run_compressor(kv, sc, 4, [None])
    np.testing.assert_allclose(rows, [[2.5, 25.0]])  # equal scores → the mean of the 4 second halves


# --------------------------------------------------------------------------------------- attention
def test_visibility_rules():
    q = np.array([0, 3, 4, 130])
    vis = raw_visibility(np, q, np.arange(131), 128)
    assert vis[0].nonzero()[0].tolist() == [0]
    assert vis[3].nonzero()[0].tolist() == list(range(3, 131))  # q − 128 < k ≤ q
    assert not raw_visibility(np, q, np.array([-5]), 128).any()  # an empty ring slot
    assert visible_rows(q, 4).tolist() == [0, 1, 1, 32]  # row c visible iff (c+1)·4 ≤ q+1
    assert visible_rows(np.array([126, 127]), 128).tolist() == [0, 1]


def test_attention_sinks_join_the_denominator():
    q = rng.normal(size=(1, 2, 4))
    keys = rng.normal(size=(3, 4))
    sinks = np.array([0.5, -1.0])
    vis = np.array([[True, False, True]])
    out = attend(np, q, keys, vis, sinks, 0.5)
    for h in range(2):
        s = [q[0, h] @ keys[r] * 0.5 for r in (0, 2)]
        den = math.exp(sinks[h]) + sum(math.exp(v) for v in s)
        want = sum(math.exp(v) / den * keys[r] for v, r in zip(s, (0, 2)))
        np.testing.assert_allclose(out[0, h], want, rtol=1e-12)


def test_indexer_relu_scale_and_topk_ties():
    q = np.array([[[1.0, 0.0], [0.0, 1.0]]])  # 1 token, 2 heads, dim 2
    w = np.array([[2.0, -1.0]])  # head weights may be negative
    k = np.array([[1.0, 1.0], [-1.0, 3.0], [2.0, -5.0], [0.5, 0.5], [-1.0, -1.0]])
    score = indexer_scores(np, q, w, k)
    # row 0: 2·1 − 1·1 = 1; row 1: 2·relu(−1) − 1·3 = −3; row 2: 2·2 − relu(−5) = 4; row 3: 1 − .5 = .5; row 4: 0
    np.testing.assert_allclose(score, [[1.0, -3.0, 4.0, 0.5, 0.0]])
    tie = np.array([[0.0, 3.0, 0.0, 0.0, 3.0, 0.0]])
    assert topk_mask(np, tie, 3).nonzero()[1].tolist() == [0, 1, 4]  # ties go to the lower index
    vis = np.array([[True] * 5])
    allowed = indexer_allowed(np, score, vis, np.array([5]), 2)
    assert allowed.nonzero()[1].tolist() == [0, 2]
    assert indexer_allowed(np, score, vis, np.array([2]), 2).all()  # not crowded → all visible rows


def test_grouped_output_maps_groups_to_row_slices():
    T, H, D, G, L = 1, 4, 3, 2, 5
    heads = rng.normal(size=(T, H, D))
    Wa = rng.normal(size=(G * L, (H // G) * D))
    Wb = rng.normal(size=(7, G * L))
    groups = [lambda x, g=g: x @ Wa[g * L:(g + 1) * L].T for g in range(G)]
    got = grouped_output(np, heads, groups, lambda x: x @ Wb.T)
    low = np.concatenate([Wa[g * L:(g + 1) * L] @ heads[0, g * 2:(g + 1) * 2].reshape(-1) for g in range(G)])
    np.testing.assert_allclose(got[0], Wb @ low, rtol=1e-12)


# ------------------------------------------------------------------------------------------- MoE
def test_router_sqrt_softplus_and_weights():
    logits = np.array([[25.0, -25.0, 0.3, 1.0]])
    p = router_probs(np, logits)
    np.testing.assert_allclose(p[0], [5.0, math.sqrt(math.exp(-25)), math.sqrt(math.log1p(math.exp(0.3))),
                                      math.sqrt(math.log1p(math.e))], rtol=1e-12)
    bias = np.array([0.0, 10.0, 0.0, 0.0])
    sel = select_topk(p + bias, 2)  # the bias changes the selection …
    assert sel.tolist() == [[1, 0]]
    w = route_weights(np, p, sel, 1.5)  # … but the weights use the unbiased p
    np.testing.assert_allclose(w[0], p[0, [1, 0]] / p[0, [1, 0]].sum() * 1.5, rtol=1e-12)
    tiny = np.full((1, 4), 1e-9)
    np.testing.assert_allclose(route_weights(np, tiny, np.array([[0, 1]]), 1.5), [[1e-9 / 2 ** -14 * 1.5] * 2])
    assert select_topk(np.array([[1.0, 2.0, 2.0, 2.0]]), 2).tolist() == [[1, 2]]  # ties → lower id


@pytest.mark.parametrize("xp_name", ["numpy", "mlx"])
def test_device_topk_is_the_stable_host_topk(xp_name):
    """Decode steps choose experts on the device by rank; the choice and its order equal the host's stable
    sort, ties included (scores drawn from a few values, so most rows tie)."""
    xp = np if xp_name == "numpy" else pytest.importorskip("mlx.core")
    rng = np.random.default_rng(3)
    scores = rng.choice(np.array([0.5, 1.0, 1.25, 2.0, 0.0], dtype=np.float32), size=(7, 64))
    scores[0] = 1.0  # every expert ties
    want = select_topk(scores, 6)
    got = np.array(select_topk_on_device(xp, xp.array(scores), 6))
    assert np.array_equal(got, want)


def test_softplus_branches():
    x = np.array([21.0, -21.0, 0.0])
    np.testing.assert_allclose(softplus(np, x), [21.0, math.exp(-21), math.log(2)], rtol=1e-15)


def test_swiglu_clamp_sides():
    g = np.array([20.0, -20.0, 1.0])
    u = np.array([20.0, -20.0, -20.0])
    got = swiglu(np, g, u, 10.0)
    silu = lambda z: z / (1 + math.exp(-z))  # noqa: E731
    np.testing.assert_allclose(got, [silu(10) * 10, silu(-20) * -10, silu(1) * -10], rtol=1e-12)


def test_routed_experts_weight_before_down_and_duplicates():
    T, E, F = 3, 4, 5
    f = rng.normal(size=(T, E))
    mats = {e: (rng.normal(size=(F, E)), rng.normal(size=(F, E)), rng.normal(size=(E, F))) for e in range(3)}
    experts = lambda e: tuple((lambda x, m=m: x @ m.T) for m in mats[e])  # noqa: E731
    sel = np.array([[0, 1], [2, 0], [1, 1]])  # token 2 picks expert 1 twice (possible in a hash table)
    w = np.array([[0.5, 1.0], [2.0, 0.25], [0.3, 0.7]])
    got = routed_experts(Ops(B), f, sel, w, experts, 10.0)
    for t in range(T):
        want = np.zeros(E)
        for j in range(2):
            G, U, Dn = mats[sel[t, j]]
            mid = swiglu(np, G @ f[t], U @ f[t], 10.0) * w[t, j]
            want += Dn @ mid
        np.testing.assert_allclose(got[t], want, rtol=1e-12)
