"""ds4lab.sampling against ds4's sampler (docs/MODEL.md, "Sampling"; ds4.c:15089-15298, 17643-17703)."""

import math

import numpy as np
import pytest

from ds4lab.sampling import (
    DEFAULT_MIN_P,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
    NEG_INF,
    TOP_K_MAX,
    Rng,
    argmax,
    sample,
    token_and_top_logprobs,
    token_logprob,
    top_logprobs,
)

F32 = np.float32
M64 = (1 << 64) - 1


class FixedU:
    """A stand-in RNG whose uniform() returns given values (to steer the draw by hand)."""

    def __init__(self, *us):
        self.us = list(us)
        self.calls = 0

    def uniform(self):
        self.calls += 1
        return self.us.pop(0)


def xorshift64star(state):
    """The formula, in plain Python integers: returns (new_state, output)."""
    x = state or 0x9E3779B97F4A7C15
    x ^= x >> 12
    x ^= (x << 25) & M64
    x ^= x >> 27
    return x, (x * 0x2545F4914F6CDD1D) & M64


# ----------------------------------------------------------------------------------------------------------
# A literal, loop-by-loop port of ds4.c's sampler with float32 scalars, used as the reference.
# ----------------------------------------------------------------------------------------------------------


def _ref_expf(x):
    x = F32(x)
    if np.isnan(x):
        return F32(np.nan)
    try:
        return F32(math.exp(float(x)))
    except OverflowError:
        return F32(np.inf)


def ref_argmax(logits):
    best, best_v = 0, F32(-1e30)
    for i, v in enumerate(logits):
        if v > best_v:
            best_v, best = v, i
    return best


def ref_sample(logits, temperature, top_k, top_p, min_p, rng):
    logits = [F32(v) for v in logits]
    n_vocab = len(logits)
    temperature, top_p, min_p = F32(temperature), F32(top_p), F32(min_p)
    with np.errstate(all="ignore"):
        if temperature <= 0:
            return ref_argmax(logits)
        if top_p <= 0 or top_p > 1:
            top_p = F32(1)
        if min_p < 0:
            min_p = F32(0)
        if top_k <= 0:
            return ref_full_vocab(logits, temperature, top_p, min_p, rng)
        top_k = min(top_k, 1024, n_vocab)
        ids, vals = [], []
        for i, v in enumerate(logits):
            if not np.isfinite(v):
                continue
            if len(vals) == top_k and v <= vals[-1]:
                continue
            if len(vals) < top_k:
                ids.append(None)
                vals.append(None)
            j = len(vals) - 1
            while j > 0 and vals[j - 1] < v:
                vals[j], ids[j] = vals[j - 1], ids[j - 1]
                j -= 1
            vals[j], ids[j] = v, i
        if not vals:
            return ref_argmax(logits)
        probs, s = [], F32(0)
        for v in vals:
            probs.append(_ref_expf((v - vals[0]) / temperature))
            s = F32(s + probs[-1])
        if s <= 0 or not np.isfinite(s):
            return ids[0]
        min_prob = F32(probs[0] / s) * min_p
        fs, filtered = F32(0), 0
        for i in range(len(vals)):
            p = F32(probs[i] / s)
            if i > 0 and p < min_prob:
                break
            fs = F32(fs + probs[i])
            filtered += 1
            if F32(fs / s) >= top_p:
                break
        r = F32(rng.uniform()) * fs
        for i in range(filtered):
            r = F32(r - probs[i])
            if r <= 0:
                return ids[i]
        return ids[filtered - 1]


def ref_full_vocab(logits, temperature, top_p, min_p, rng):
    max_logit, best, finite = F32(-1e30), 0, 0
    for i, v in enumerate(logits):
        if not np.isfinite(v):
            continue
        finite += 1
        if v > max_logit:
            max_logit, best = v, i
    if finite == 0:
        return ref_argmax(logits)
    if top_p >= 1:
        s = F32(0)
        min_rel = min_p if min_p > 0 else F32(0)
        for v in logits:
            if not np.isfinite(v):
                continue
            p = _ref_expf((v - max_logit) / temperature)
            if p < min_rel:
                continue
            s = F32(s + p)
        if s <= 0 or not np.isfinite(s):
            return best
        r = F32(rng.uniform()) * s
        for i, v in enumerate(logits):
            if not np.isfinite(v):
                continue
            p = _ref_expf((v - max_logit) / temperature)
            if p < min_rel:
                continue
            r = F32(r - p)
            if r <= 0:
                return i
        return best
    cand, s = [], F32(0)
    for i, v in enumerate(logits):
        if not np.isfinite(v):
            continue
        p = _ref_expf((v - max_logit) / temperature)
        cand.append((i, v, p))
        s = F32(s + p)
    if s <= 0 or not np.isfinite(s):
        return best
    cand.sort(key=lambda c: -c[1])  # stable: ties keep id order
    min_prob = F32(cand[0][2] / s) * (min_p if min_p > 0 else F32(0))
    fs, filtered = F32(0), 0
    for i, (_, _, prob) in enumerate(cand):
        p = F32(prob / s)
        if i > 0 and p < min_prob:
            break
        fs = F32(fs + prob)
        filtered += 1
        if F32(fs / s) >= top_p:
            break
    r = F32(rng.uniform()) * fs
    for i in range(filtered):
        r = F32(r - cand[i][2])
        if r <= 0:
            return cand[i][0]
    return cand[filtered - 1][0]


# ----------------------------------------------------------------------------------------------------------
# RNG
# ----------------------------------------------------------------------------------------------------------


def test_rng_seed1_by_hand():
    # seed 1: x=1; x^=x>>12 -> 1; x^=x<<25 -> 0x2000001; x^=x>>27 -> 0x2000001 (0x2000001>>27 == 0)
    rng = Rng(1)
    assert rng.state == 1
    out = rng.next_u64()
    assert rng.state == 0x2000001  # the shifted value is the new state
    # 0x2000001 * C = C + (C << 25) mod 2^64
    c = 0x2545F4914F6CDD1D
    assert out == (c + (c << 25)) % 2**64 == 0x47E4CE4B896CDD1D
    # the next ones from the formula in plain integers
    state, outs = 0x2000001, []
    for _ in range(5):
        state, o = xorshift64star(state)
        outs.append((state, o))
    for st, o in outs:
        assert rng.next_u64() == o
        assert rng.state == st


def test_rng_uniform_seed1():
    rng, state = Rng(1), 1
    for _ in range(6):
        state, o = xorshift64star(state)
        u = rng.uniform()
        assert u == ((o >> 40) & 0xFFFFFF) / 2**24
        assert 0.0 <= u < 1.0 and float(np.float32(u)) == u  # exact in float32
    # first value by hand: 0x47E4CE4B896CDD1D >> 40 = 0x47E4CE
    assert Rng(1).uniform() == 0x47E4CE / 2**24 == 0.28083503246307373


def test_rng_seed0_replaced():
    rng = Rng(0)
    assert rng.state == 0  # replaced lazily, at the draw (ds4.c:15124)
    golden = Rng(0x9E3779B97F4A7C15)
    assert [rng.next_u64() for _ in range(4)] == [golden.next_u64() for _ in range(4)]
    assert rng.state == golden.state != 0
    st, o = xorshift64star(0x9E3779B97F4A7C15)
    assert Rng(0).next_u64() == o and o == (st * 0x2545F4914F6CDD1D) & M64
    assert (st, o) == (0x03F721DFFE39B342, 0x0D83B3E29A21487A)
    assert Rng(0).uniform() == 0x0D83B3 / 2**24


def test_rng_state_checkpoint_and_bounds():
    rng = Rng(12345)
    for _ in range(3):
        rng.next_u64()
    saved = rng.state
    a = [rng.next_u64() for _ in range(5)]
    rng.state = saved
    assert [rng.next_u64() for _ in range(5)] == a
    c = Rng(7)
    d = c.copy()
    assert c.uniform() == d.uniform()
    Rng(M64).next_u64()
    with pytest.raises(ValueError):
        Rng(-1)
    with pytest.raises(ValueError):
        Rng(1 << 64)
    with pytest.raises(TypeError):
        Rng(1.5)


# ----------------------------------------------------------------------------------------------------------
# Greedy
# ----------------------------------------------------------------------------------------------------------


def test_defaults_match_ds4_h():
    assert (DEFAULT_TEMPERATURE, DEFAULT_TOP_P, DEFAULT_MIN_P, DEFAULT_TOP_K) == (1.0, 1.0, 0.05, 0)
    assert TOP_K_MAX == 1024


def test_greedy_first_max_and_no_draw():
    logits = np.array([0.5, 3.0, -1.0, 3.0, np.nan], dtype=np.float32)
    assert argmax(logits) == 1
    for t in (0.0, -0.0, -2.0):
        rng = FixedU()
        assert sample(logits, temperature=t, rng=rng) == 1
        assert rng.calls == 0
    real = Rng(5)
    sample(logits, temperature=0.0, rng=real)
    assert real.state == 5


def test_argmax_ds4_quirks():
    assert argmax(np.array([np.nan, 1.0, np.inf, np.inf], np.float32)) == 2  # +inf wins, NaN never
    assert argmax(np.array([-np.inf, -np.inf], np.float32)) == 0
    assert argmax(np.array([-5e30, -2e30, -3e30], np.float32)) == 0  # nothing beats DS4_NEG_INF = -1e30
    with pytest.raises(ValueError):
        argmax(np.zeros(0, np.float32))
    with pytest.raises(ValueError):
        sample(np.zeros((2, 3), np.float32))


# ----------------------------------------------------------------------------------------------------------
# Rule 2: temperature + min_p, token-id order
# ----------------------------------------------------------------------------------------------------------


def test_rule2_by_hand():
    # weights exp(l - 0): [1, e^-10 (< 0.05: dropped), 1, e^-1 = 0.3679, -, -]
    logits = np.array([0.0, -10.0, 0.0, -1.0, -np.inf, np.nan], np.float32)
    w3 = F32(math.exp(-1.0))
    s = F32(F32(F32(1) + F32(1)) + w3)
    # r = u * sum, then r -= w in id order over the kept tokens {0, 2, 3}; first r <= 0 wins
    assert sample(logits, rng=FixedU(0.0)) == 0
    assert sample(logits, rng=FixedU(0.99 / float(s))) == 0
    assert sample(logits, rng=FixedU(1.5 / float(s))) == 2
    assert sample(logits, rng=FixedU(0.999)) == 3
    # without min_p token 1 takes part, between 0 and 2
    s0 = F32(F32(F32(1) + F32(math.exp(-10.0))) + F32(1))
    u = (1.0 + 0.5 * math.exp(-10.0)) / float(F32(s0 + w3))
    assert sample(logits, min_p=0.0, rng=FixedU(u)) == 1


def test_rule2_le_comparison_and_min_p_strict():
    logits = np.zeros(2, np.float32)  # weights [1, 1], sum 2
    assert sample(logits, rng=FixedU(0.5)) == 0  # r = 1; 1 - 1 = 0 <= 0 -> token 0
    assert sample(logits, rng=FixedU(0.5 + 2**-24)) == 1
    # `p < min_rel` drops; p == min_p is kept
    logits = np.array([0.0, -3.0], np.float32)
    w = float(F32(math.exp(-3.0)))
    assert sample(logits, min_p=w, rng=FixedU(0.999)) == 1
    assert sample(logits, min_p=float(np.nextafter(F32(w), F32(1))), rng=FixedU(0.999)) == 0


def test_rule2_all_filtered_returns_best_without_draw():
    logits = np.array([0.0, 2.0, 2.0, 1.0], np.float32)
    rng = FixedU()
    assert sample(logits, min_p=1.5, rng=rng) == 1  # every weight < 1.5: sum 0 -> best, no draw
    assert rng.calls == 0


def _chi2(counts, probs, n):
    exp = np.asarray(probs) * n
    return float(((np.asarray(counts) - exp) ** 2 / exp).sum())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rule2_frequencies(temperature):
    logits = np.array([1.0, 0.5, 0.0, -0.5, -4.0, -np.inf, 0.25], np.float32)
    w = np.exp((logits.astype(np.float64) - 1.0) / temperature)
    w[~(w >= 0.05)] = 0
    p = w / w.sum()
    rng, n = Rng(20240601), 8000
    counts = np.bincount([sample(logits, temperature=temperature, rng=rng) for _ in range(n)], minlength=7)
    assert counts[4] == 0 and counts[5] == 0
    keep = p > 0
    assert _chi2(counts[keep], p[keep], n) < 25.0  # df = 4; p-value ~5e-5 (fixed seed: deterministic)


# ----------------------------------------------------------------------------------------------------------
# Rule 3: top_p < 1, sorted by logit
# ----------------------------------------------------------------------------------------------------------


LOG4 = np.log(np.array([0.1, 0.4, 0.2, 0.3])).astype(np.float32)  # sorted: 1 (.4), 3 (.3), 2 (.2), 0 (.1)


def test_rule3_crossing_token_included():
    seen = set()
    rng = Rng(99)
    for _ in range(400):
        seen.add(sample(LOG4, top_p=0.65, min_p=0.0, rng=rng))
    assert seen == {1, 3}  # 0.4 < 0.65 <= 0.7: the crossing token 3 is kept
    seen = {sample(LOG4, top_p=0.35, min_p=0.0, rng=rng) for _ in range(200)}
    assert seen == {1}
    seen = {sample(LOG4, top_p=0.95, min_p=0.0, rng=rng) for _ in range(400)}
    assert seen == {0, 1, 2, 3}


def test_rule3_sorted_descending_draw_order():
    # u = 0 draws the first candidate: the highest logit (token 1) here, the lowest kept id under rule 2
    assert sample(LOG4, top_p=0.99, min_p=0.0, rng=FixedU(0.0)) == 1
    assert sample(LOG4, top_p=1.0, min_p=0.0, rng=FixedU(0.0)) == 0
    assert sample(LOG4, top_p=0.99, min_p=0.0, rng=FixedU(0.999)) == 0  # last in sorted order
    # r = 0.5 * 1.0: 0.5 - 0.4 > 0, 0.1 - 0.3 <= 0 -> token 3 (rule 2 would say token 1: 0.5-0.1-0.4 <= 0)
    assert sample(LOG4, top_p=0.99, min_p=0.0, rng=FixedU(0.5)) == 3


def test_rule3_min_p_relative_to_top():
    rng = Rng(3)
    # p_0 = 0.4: min_p 0.6 -> 0.24 keeps 0.3, drops 0.2; min_p 0.8 -> 0.32 keeps only the top
    assert {sample(LOG4, top_p=0.99, min_p=0.6, rng=rng) for _ in range(300)} == {1, 3}
    assert {sample(LOG4, top_p=0.99, min_p=0.8, rng=rng) for _ in range(50)} == {1}
    # min_p > 1: the top token is exempt (i = 0), so it is drawn (one RNG value consumed)
    r = FixedU(0.3)
    assert sample(LOG4, top_p=0.9, min_p=3.0, rng=r) == 1 and r.calls == 1


def test_rule3_frequencies():
    logits = np.array([0.2, 1.0, -0.3, 0.7, 0.0, -2.0], np.float32)
    w = np.exp(logits.astype(np.float64) - 1.0)
    q = w / w.sum()
    order = np.argsort(-logits, kind="stable")
    cum = np.cumsum(q[order])
    kept = order[: int(np.searchsorted(cum, 0.8)) + 1]
    p = np.zeros(6)
    p[kept] = q[kept] / q[kept].sum()
    rng, n = Rng(777), 6000
    counts = np.bincount([sample(logits, top_p=0.8, min_p=0.0, rng=rng) for _ in range(n)], minlength=6)
    assert set(np.flatnonzero(counts)) == set(kept.tolist())
    assert _chi2(counts[kept], p[kept], n) < 25.0


# ----------------------------------------------------------------------------------------------------------
# Rule 4: top_k
# ----------------------------------------------------------------------------------------------------------


def test_top_k_basic_and_renormalised():
    rng = Rng(11)
    assert {sample(LOG4, top_k=2, min_p=0.0, rng=rng) for _ in range(300)} == {1, 3}
    assert {sample(LOG4, top_k=1, rng=rng) for _ in range(20)} == {1}
    # normalised over the top 2: 0.571, 0.429 -> top_p 0.5 keeps only the first; full vocab would keep 2 tokens
    assert {sample(LOG4, top_k=2, top_p=0.5, min_p=0.0, rng=rng) for _ in range(100)} == {1}
    assert {sample(LOG4, top_k=0, top_p=0.5, min_p=0.0, rng=rng) for _ in range(300)} == {1, 3}
    # ties: equal logits keep the lower ids
    flat = np.zeros(10, np.float32)
    assert {sample(flat, top_k=3, rng=rng) for _ in range(200)} == {0, 1, 2}
    # top_k larger than the vocabulary
    assert {sample(LOG4, top_k=50, min_p=0.0, rng=rng) for _ in range(400)} == {0, 1, 2, 3}


def test_top_k_cap_1024():
    flat = np.zeros(3000, np.float32)
    flat[2000] = -np.inf
    a, b, c = Rng(5), Rng(5), Rng(5)
    xs = [sample(flat, top_k=3000, rng=a) for _ in range(300)]
    assert xs == [sample(flat, top_k=1024, rng=b) for _ in range(300)]
    assert xs == [sample(flat, top_k=10**12, rng=c) for _ in range(300)]
    assert max(xs) < 1024 and max(xs) > 900
    assert max(sample(flat, top_k=1025, rng=a) for _ in range(300)) < 1024


# ----------------------------------------------------------------------------------------------------------
# Seeds, parameters, agreement with the literal C port
# ----------------------------------------------------------------------------------------------------------


def _seq(seed, logits, n=200, **kw):
    rng = Rng(seed)
    return [sample(logits, rng=rng, **kw) for _ in range(n)]


def test_seeds_reproduce():
    logits = np.random.default_rng(0).normal(size=500).astype(np.float32)
    for kw in ({}, {"top_p": 0.9}, {"top_k": 40, "temperature": 0.8}):
        assert _seq(42, logits, **kw) == _seq(42, logits, **kw)
        assert _seq(42, logits, **kw) != _seq(43, logits, **kw)


def test_out_of_range_parameters_fixed_like_ds4():
    logits = np.random.default_rng(1).normal(size=300).astype(np.float32)
    base = _seq(9, logits, min_p=0.0)
    for tp in (0.0, -0.5, 1.5, np.inf):  # top_p not in (0, 1] -> 1
        assert _seq(9, logits, top_p=tp, min_p=0.0) == base
    assert _seq(9, logits, min_p=-0.3) == base  # min_p < 0 -> 0
    assert _seq(9, logits, min_p=-0.3, top_k=-7) == base  # top_k <= 0 -> full vocabulary
    # a top_p that rounds to 1.0f in float is rule 2
    assert _seq(9, logits, top_p=1 - 1e-9, min_p=0.0) == base
    # NaN parameters behave as in ds4 (no crash): NaN temperature -> first maximal finite logit, no draw
    rng = FixedU()
    logits2 = np.array([np.inf, 1.0, 3.0, 3.0], np.float32)
    assert sample(logits2, temperature=float("nan"), rng=rng) == 2 and rng.calls == 0
    assert sample(logits2, temperature=0.0) == 0  # greedy itself does take +inf
    assert _seq(9, logits, min_p=float("nan")) == base  # NaN min_p acts as 0
    with pytest.raises(TypeError):
        sample(logits, top_k=2.5)


def test_all_nonfinite_and_tiny_vocab():
    assert sample(np.array([np.nan, -np.inf], np.float32), rng=FixedU()) == 0
    assert sample(np.array([-np.inf, np.nan, np.inf], np.float32), top_k=5, rng=FixedU()) == 2
    assert sample(np.array([2.5], np.float32), rng=Rng(1)) == 0


@pytest.mark.parametrize("case_seed", range(6))
def test_matches_literal_c_port(case_seed):
    g = np.random.default_rng(1000 + case_seed)
    for _ in range(60):
        n = int(g.integers(1, 70))
        kind = g.integers(4)
        if kind == 0:
            logits = g.normal(scale=g.choice([0.3, 2.0, 8.0]), size=n)
        elif kind == 1:
            logits = g.integers(-3, 2, size=n).astype(np.float64)  # many exact ties
        elif kind == 2:
            logits = g.normal(size=n) * 0.01  # nearly uniform: many boundaries close together
        else:
            logits = g.normal(size=n)
            logits[g.random(n) < 0.2] = g.choice([-np.inf, np.nan, np.inf, -2e30])
        logits = logits.astype(np.float32)
        t = float(g.choice([1.0, 0.7, 1.6, 0.05, 0.0, 1e-3]))
        top_k = int(g.choice([0, 0, 1, 3, 20, 2000, -1]))
        top_p = float(g.choice([1.0, 0.9, 0.5, 0.999, 0.0, 1.2, 0.1]))
        min_p = float(g.choice([0.05, 0.0, 0.2, 0.9, -1.0, 1.5]))
        seed = int(g.integers(0, 2**63))
        a, b = Rng(seed), Rng(seed)
        for _ in range(4):
            got = sample(logits, t, top_k, top_p, min_p, rng=a)
            want = ref_sample(logits, t, top_k, top_p, min_p, rng=b)
            assert got == want, (logits, t, top_k, top_p, min_p)
            assert a.state == b.state  # same number of draws


def test_matches_c_port_at_exact_boundaries():
    # Steer u so r lands exactly on, or one float step around, each cumulative boundary.
    g = np.random.default_rng(5)
    for _ in range(40):
        logits = (g.integers(-4, 1, size=12) * 0.5).astype(np.float32)
        for top_p, top_k in ((1.0, 0), (0.9, 0), (0.8, 5)):
            for u in g.integers(0, 2**24, size=6) / 2**24:
                assert sample(logits, 1.0, top_k, top_p, 0.0, FixedU(u)) == \
                    ref_sample(logits, 1.0, top_k, top_p, 0.0, FixedU(u))


# ----------------------------------------------------------------------------------------------------------
# log-probabilities
# ----------------------------------------------------------------------------------------------------------


def _log_softmax64(logits):
    x = logits.astype(np.float64)
    f = np.isfinite(x)
    m = x[f].max()
    return x - (m + np.log(np.exp(x[f] - m).sum()))


def test_top_logprobs_against_float64():
    g = np.random.default_rng(2)
    logits = (g.normal(size=1000) * 3).astype(np.float32)
    ref = _log_softmax64(logits)
    out = top_logprobs(logits, 8)
    assert [i for i, _ in out] == list(np.argsort(-logits, kind="stable")[:8])
    for i, lp in out:
        assert abs(lp - ref[i]) < 1e-5 and lp == float(np.float32(lp))
    # -inf and NaN logits are ignored: neither listed nor summed
    with_inf = np.concatenate([logits, np.array([-np.inf, np.nan, -np.inf], np.float32)])
    assert top_logprobs(with_inf, 8) == out
    assert token_logprob(with_inf, 5) == token_logprob(logits, 5)
    assert abs(token_logprob(logits, 5) - ref[5]) < 1e-5
    assert token_logprob(with_inf, 1000) == NEG_INF == float(np.float32(-1e30))  # DS4_NEG_INF, not -inf


def test_top_logprobs_edges():
    logits = np.array([1.0, 3.0, 3.0, -np.inf, 0.0], np.float32)
    out = top_logprobs(logits, 10)  # k > finite count: only the finite ones, ties by lower id
    assert [i for i, _ in out] == [1, 2, 0, 4]
    assert top_logprobs(logits, 1) == out[:1]  # k = 1 (argmax): the first of the tied largest
    assert top_logprobs(logits, 2) == out[:2]
    lse = 3.0 + math.log(2 + math.exp(-2) + math.exp(-3))
    assert out[0][1] == pytest.approx(-lse + 3.0, abs=1e-6)
    assert top_logprobs(logits, 0) == [] and top_logprobs(logits, -3) == []
    assert sum(math.exp(lp) for _, lp in out) == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(ValueError):
        token_logprob(logits, 5)
    with pytest.raises(ValueError):
        token_logprob(logits, -1)
    assert top_logprobs(np.array([np.nan, -np.inf], np.float32), 3) == []



def test_token_and_top_logprobs_is_both_at_once():
    g = np.random.default_rng(3)
    logits = (g.normal(size=3000) * 3).astype(np.float32)
    for row in (logits, np.concatenate([logits, np.array([-np.inf, np.nan], np.float32)])):
        for token, k in ((7, 5), (int(np.argmax(row)), 1), (2999, 0), (row.size - 1, 3)):
            assert token_and_top_logprobs(row, token, k) == (token_logprob(row, token), top_logprobs(row, k))
    with pytest.raises(ValueError):
        token_and_top_logprobs(logits, 3000, 5)


# Rule 2 weighs only the logits that can pass min_p (a bound from the largest logit and the temperature):
# at a few thousand logits, against the literal port, with the draws steered onto the cumulative boundaries
# and logits placed around the cut, expf((v - max)/T) = min_p, at one float step on either side.
@pytest.mark.parametrize("temperature", [1.0, 0.05, 7.0, 1e-30, 3e38])
@pytest.mark.parametrize("min_p", [0.05, 1e-30, 0.9, 1.0, 1.5, np.inf])
def test_rule2_large_vocab_matches_c_port(temperature, min_p):
    g = np.random.default_rng(int(temperature * 1e3) % 1000 + int(min(min_p, 9) * 100))
    logits = (g.normal(size=3000) * 4).astype(np.float32)
    top = logits.max()
    if 0 < min_p < np.inf and temperature < 1e30:
        cut = F32(top + F32(temperature) * F32(math.log(min_p)))
        around = [cut, np.nextafter(cut, F32(np.inf)), np.nextafter(cut, F32(-np.inf))]
        logits[g.choice(3000, 3, replace=False)] = np.array(around, np.float32).clip(None, top)
    for u in (0.0, 0.3, 0.999, 0.5):
        assert sample(logits, temperature, 0, 1.0, min_p, FixedU(u)) == \
            ref_sample(logits, temperature, 0, 1.0, min_p, FixedU(u))


def test_the_device_argmax_is_the_host_argmax():
    """argmax_on_device (here over NumPy) chooses as argmax does: the first maximal logit, NaN never, nothing at or
    below -1e30 (token 0 when that is all), excluded ids never."""
    from ds4lab.sampling import argmax_on_device

    rng = np.random.default_rng(3)
    cases = [np.array([[1.0, np.nan, 3.0, 3.0, -2.0]], np.float32), np.full((1, 4), -np.inf, np.float32),
             np.array([[-1e31, -2e30, np.nan, -1e30]], np.float32), np.full((1, 4), np.nan, np.float32),
             rng.standard_normal((3, 50)).astype(np.float32)]
    for logits in cases:
        for exclude in (None, np.array([2, 3])):
            host = logits.copy()
            if exclude is not None:
                host[:, exclude] = -np.inf
            got = argmax_on_device(np, logits, exclude)
            assert got.dtype == np.int32 and list(got) == [argmax(row) for row in host], (logits, exclude)


def test_the_device_sampler_is_ds4s_rule_2_bit_for_bit_on_numpy():
    """sample_on_device over NumPy draws what sample draws with ds4's default rule (positive temperature, no top_k,
    no top_p cut, min_p) from the same uniform, over random rows, peaked and flat ones, non-finite logits,
    excluded ids, min_p from 0 to past 1 (nothing kept: the best token), and the draws at the ends of [0, 1)."""
    from ds4lab.sampling import sample_on_device, weighted_rule

    rng = np.random.default_rng(8)
    assert weighted_rule(1.0, 0, 1.0) and weighted_rule(0.7, -1, 0.0) and weighted_rule(1.0, 0, 1.0 - 1e-9)
    assert not any(weighted_rule(*p) for p in [(0.0, 0, 1.0), (1.0, 40, 1.0), (1.0, 0, 0.9), (np.nan, 0, 1.0),
                                               (np.inf, 0, 1.0), (1.0, 0, np.nan), (1.0, 2.5, 1.0)])
    checked = 0
    for case in range(60):
        logits = (rng.standard_normal(700) * rng.choice([0.3, 3.0, 12.0])).astype(np.float32)
        if case % 5 == 1:
            logits[rng.integers(0, 700, 20)] = rng.choice([np.nan, np.inf, -np.inf])
        if case % 7 == 2:
            logits[:] = -np.inf
        if case % 11 == 3:  # finite, but none above -1e30: no weights, the best token is 0
            logits[:] = np.float32(-2e30)
        exclude = rng.integers(0, 700, 3) if case % 3 == 0 else np.zeros(0, np.int64)
        t, mp = float(rng.choice([0.3, 1.0, 2.5])), float(rng.choice([0.0, 0.05, 0.5, 1.5, -1.0, np.nan]))
        for seed in (int(rng.integers(1, 2**63)), 0):
            host = logits.copy()
            host[exclude] = -np.inf
            peek = Rng(seed)
            u = np.float32(Rng(seed).uniform())
            want = sample(host, temperature=t, top_k=0, top_p=1.0, min_p=mp, rng=peek)
            got = sample_on_device(np, logits[None], u, t, mp, exclude)
            assert got.dtype == np.int32 and got.shape == (1,) and int(got[0]) == want, (case, seed, t, mp)
            checked += 1
    logits = rng.standard_normal(50).astype(np.float32)
    weights = np.exp((logits - logits.max()).astype(np.float64)).astype(np.float32)
    kept = np.flatnonzero(~(weights < np.float32(0.05)))
    for u, token in ((0.0, kept[0]), (1.0 - 2.0 ** -24, kept[-1])):  # the draw's ends: the first and the last kept
        want = sample(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.05, rng=FixedU(u))
        assert int(sample_on_device(np, logits[None], np.float32(u), 1.0, 0.05)[0]) == want == token
    assert checked == 120


def test_exclude_mask_sets_one_bit_an_id_and_names_a_bad_one():
    from ds4lab.sampling import exclude_mask

    words = exclude_mask([0, 31, 32, 69, 69], 70).view(np.uint32)
    assert words.tolist() == [1 | 1 << 31, 1, 1 << 5]  # ids 0 and 31; 32; 69 (given twice)
    assert exclude_mask([], 33).tolist() == [0, 0]
    with pytest.raises(ValueError, match=r"exclude: ids must be in \[0, 70\), got 3..70"):
        exclude_mask([3, 70], 70)


def test_draw_params_are_the_kernels_float32_rule2_parameters():
    from ds4lab.sampling import draw_params

    got = draw_params(np.float32(0.25), 0.7, 0.05)
    assert got.dtype == np.float32 and got.tolist() == [np.float32(0.7), np.float32(0.05), 0.25]
    assert draw_params(0.5, 1.0, -1.0)[1] == 0.0  # min_p at or below 0: nothing dropped
    with pytest.raises(TypeError, match="temperature must be a real number"):
        draw_params(0.5, "hot", 0.05)
