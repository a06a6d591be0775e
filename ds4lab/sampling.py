"""Token sampling, exactly as ds4 does it (docs/MODEL.md, "Sampling"; ds4.c ``sample_*`` and
``ds4_session_*logprob*``).

ds4's sampler works in C ``float`` throughout; only the log-probability helpers use ``double``.  This module
reproduces that arithmetic with ``np.float32`` / ``np.float64`` so that the chosen token is the same as the
one the C code computes from the same logits and the same RNG state:

* every ``float`` operation of ds4 (``v - max``, ``/ T``, ``sum += p``, ``p / sum``, ``u * sum``,
  ``r -= p``) is done as an IEEE float32 operation here, in the same order;
* running sums and the sequential "``r -= p``; stop at ``r <= 0``" scan are done with
  ``np.add.accumulate`` in float32.  ``np.add.accumulate`` is a left-to-right recurrence
  ``out[i] = fl32(out[i-1] + x[i])`` (numpy uses pairwise summation only for *reductions*, never for
  accumulate), and ``a + (-b)`` is bit-identical to ``a - b`` in IEEE arithmetic, so
  ``accumulate([r, -p1, -p2, ...])`` produces exactly the values ``r`` takes in ds4's loop.  (This is not
  the same as ``r - cumsum(p)``, which rounds differently; that is why the scan is not a plain
  ``searchsorted`` on a cumulative sum);
* ``expf`` is evaluated as ``float32(exp(float64(x)))``, i.e. correctly rounded; glibc's ``expf`` is
  accurate to 0.502 ulp, so the two agree except in vanishingly rare cases.

What cannot be reproduced bit-for-bit: ds4 is built with ``-O3 -ffast-math`` (Makefile ``CFLAGS``), which
lets the compiler reassociate the ``sum += p`` reductions (vectorised partial sums), use a vector ``expf``
and replace ``/ T`` by ``* (1/T)`` (identical for the default T = 1).  Those change float results in the last
bit at most and can only change the chosen token when the random draw lands within about one float32 ulp of
a cumulative boundary (probability ~1e-7 per draw).  This module follows the C source as written.

Public API::

    Rng(seed)                   xorshift64* generator (ds4.c sample_rng_next / sample_rng_f32)
    sample(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.05, rng=None) -> int
    argmax(logits) -> int
    top_logprobs(logits, k) -> list[tuple[int, float]]
    token_logprob(logits, token) -> float
    token_and_top_logprobs(logits, token, k) -> (float, list)   both, one log-sum-exp
"""

from __future__ import annotations

import operator
import os
import time

import numpy as np

__all__ = [
    "DEFAULT_MIN_P",
    "DEFAULT_TEMPERATURE",
    "DEFAULT_TOP_K",
    "DEFAULT_TOP_P",
    "NEG_INF",
    "TOP_K_MAX",
    "Rng",
    "argmax",
    "sample",
    "token_and_top_logprobs",
    "token_logprob",
    "top_logprobs",
]

# ds4.h:53-55 (DS4_DEFAULT_TEMPERATURE / TOP_P / MIN_P); top_k 0 = no cap (the CLI always passes 0).
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
DEFAULT_MIN_P = 0.05
DEFAULT_TOP_K = 0

# ds4.c:50  #define DS4_NEG_INF (-1.0e30f): the "minus infinity" ds4 starts its max searches from, and the
# logprob it reports for a token whose logit is not finite.  Not a real -inf.
NEG_INF = float(np.float32(-1.0e30))
_NEG_INF32 = np.float32(-1.0e30)

# ds4.c:15248: top_k is capped at 1024 (the sampler's fixed-size candidate arrays).
TOP_K_MAX = 1024

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # ds4.c:15124, replaces a zero state
_MULT = 0x2545F4914F6CDD1D  # ds4.c:15129, the xorshift64* output multiplier
_F32 = np.float32
_F32_ZERO = np.float32(0.0)


# --------------------------------------------------------------------------------------------------------------
# RNG
# --------------------------------------------------------------------------------------------------------------


class Rng:
    """ds4's xorshift64* generator (ds4.c:15122-15135).

    The seed *is* the 64-bit state (ds4_cli.c ``uint64_t rng = seed``; ds4_server.c likewise).  A zero state
    is replaced by 0x9e3779b97f4a7c15 at the moment of the next draw (so ``Rng(0).state == 0`` until the
    first draw).  Each draw xorshifts the state, stores the shifted value as the new state, and returns
    ``state * 0x2545F4914F6CDD1D mod 2^64`` (the multiplied value is the output only, never the state).
    """

    __slots__ = ("_state",)

    def __init__(self, seed: int):
        seed = operator.index(seed)
        if seed < 0 or seed > _MASK64:
            raise ValueError(f"seed must be an unsigned 64-bit integer, got {seed}")
        self._state = seed

    @classmethod
    def from_time(cls) -> "Rng":
        """A time-based seed the way the ds4 CLI makes one (ds4_cli.c:504): time ^ pid<<32 ^ clock()."""
        clock = int(time.process_time() * 1_000_000)  # clock() in CLOCKS_PER_SEC = 1e6 units
        return cls((int(time.time()) ^ (os.getpid() << 32) ^ clock) & _MASK64)

    @property
    def state(self) -> int:
        """The raw 64-bit state (what ds4 keeps in its ``uint64_t rng``); assignable, for checkpoints."""
        return self._state

    @state.setter
    def state(self, value: int) -> None:
        value = operator.index(value)
        if value < 0 or value > _MASK64:
            raise ValueError(f"state must be an unsigned 64-bit integer, got {value}")
        self._state = value

    def copy(self) -> "Rng":
        return Rng(self._state)

    def next_u64(self) -> int:
        """ds4.c sample_rng_next."""
        x = self._state
        if x == 0:
            x = _GOLDEN
        x ^= x >> 12
        x = (x ^ (x << 25)) & _MASK64
        x ^= x >> 27
        self._state = x
        return (x * _MULT) & _MASK64

    def uniform(self) -> float:
        """ds4.c sample_rng_f32: the top 24 bits of the output over 2^24, a float32 in [0, 1) (exact)."""
        return ((self.next_u64() >> 40) & 0xFFFFFF) / 16777216.0

    def __repr__(self) -> str:
        return f"Rng(state=0x{self._state:016x})"


_default_rng: Rng | None = None


def _get_default_rng() -> Rng:
    global _default_rng
    if _default_rng is None:
        _default_rng = Rng.from_time()
    return _default_rng


# --------------------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------------------


def _as_logits(logits) -> np.ndarray:
    a = np.asarray(logits)
    if a.ndim != 1:
        raise ValueError(f"logits must be a 1-D array [vocab], got shape {a.shape}")
    if a.size == 0:
        # ds4 would return token 0 of an empty vocabulary; there is no valid answer.
        raise ValueError("logits is empty")
    if a.dtype != np.float32:
        if not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
            raise TypeError(f"logits must be a real array, got dtype {a.dtype}")
        with np.errstate(over="ignore"):
            a = a.astype(np.float32)  # ds4 receives `const float *logits`
    return a


def _as_f32(name: str, value) -> np.float32:
    """A C `float` parameter: a Python number rounded to float32 (overflow -> inf, as the C cast does)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {value!r}") from None
    with np.errstate(over="ignore"):
        return np.float32(v)


def _finite(a: np.ndarray) -> tuple["_Ids", np.ndarray]:
    """The ids of the finite logits and their values, ``(ids, a[ids])``; where all are finite (a model's
    logits usually are) ``a`` itself and ids that are the positions, with no array made for either: at
    Flash's 129,280 logits ``flatnonzero``, the gather or an ``arange`` each cost more than the test."""
    finite = np.isfinite(a)
    if finite.all():
        return _Ids(None), a
    ids = np.flatnonzero(finite)
    return _Ids(ids), a[ids]


class _Ids:
    """Token ids by position among the finite logits: ``ids[pos]`` (None: every logit is finite, pos is the id)."""

    __slots__ = ("ids",)

    def __init__(self, ids: np.ndarray | None):
        self.ids = ids

    def __getitem__(self, pos):
        return pos if self.ids is None else self.ids[pos]


def _expf(x: np.ndarray) -> np.ndarray:
    """expf on a float32 array, correctly rounded: float32(exp(float64(x)))."""
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        return np.exp(x.astype(np.float64)).astype(np.float32)


def _weights(vals: np.ndarray, max_logit: np.float32, temperature: np.float32) -> np.ndarray:
    """ds4's ``expf((v - max_logit) / temperature)`` with float32 subtraction and division."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        return _expf((vals - max_logit) / temperature)


def _seq_sum(x: np.ndarray) -> np.float32:
    """``float sum = 0; for (...) sum += x[i];`` -- sequential float32 (accumulate is a left-to-right recurrence)."""
    if x.size == 0:
        return _F32_ZERO
    with np.errstate(over="ignore", invalid="ignore"):
        return np.add.accumulate(x, dtype=np.float32)[-1]


def _scan(r: np.float32, probs: np.ndarray) -> int:
    """ds4's draw loop ``for i: { r -= probs[i]; if (r <= 0) return i; }``; -1 if it runs off the end.

    ``accumulate([r, -p0, -p1, ...])`` in float32 reproduces every intermediate ``r`` bit for bit
    (x + (-p) == x - p exactly in IEEE arithmetic, and accumulate is strictly sequential).
    """
    a = np.empty(probs.size + 1, dtype=np.float32)
    a[0] = r
    np.negative(probs, out=a[1:])
    with np.errstate(over="ignore", invalid="ignore"):
        rs = np.add.accumulate(a)[1:]
    hit = np.flatnonzero(rs <= 0)
    return int(hit[0]) if hit.size else -1


def _top_sorted(vals: np.ndarray, m: int) -> np.ndarray:
    """Positions of the first ``m`` elements of ``vals`` in (value descending, position ascending) order.

    This is the order ds4's insertion loops produce (they move an element up only past strictly smaller
    ones, ds4.c:15259-15263 and 17654-17661), i.e. a stable descending sort.  ``vals`` must not contain NaN.
    """
    n = vals.size
    if m >= n:
        return np.argsort(-vals, kind="stable")
    if m == 1:  # argmax gives the first of the largest; at Flash's 129,280 values 100x faster than a partition
        return np.array([np.argmax(vals)])
    thresh = np.partition(vals, n - m)[n - m]  # the m-th largest value
    pool = np.flatnonzero(vals >= thresh)  # >= m positions, in ascending order; ties at thresh all included
    order = np.argsort(-vals[pool], kind="stable")[:m]
    return pool[order]


def _filter(probs: np.ndarray, total: np.float32, min_prob: np.float32, top_p: np.float32) -> tuple[int, bool]:
    """ds4's min_p/top_p head filter over candidates sorted by logit (ds4.c:15210-15219, 15281-15290)::

        for i: p = probs[i] / sum
               if (i > 0 && p < min_prob) break;
               filtered_sum += probs[i]; filtered++;
               if (filtered_sum / sum >= top_p) break;

    Returns ``(filtered, stopped)``; ``stopped`` is False when the loop ran off the end of ``probs`` without
    a break (the caller then knows whether a prefix of the candidates was enough).
    """
    n = probs.size
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        pn = probs / total
        k_min = np.flatnonzero(pn[1:] < min_prob)
        k_min = int(k_min[0]) + 1 if k_min.size else n
        cum = np.add.accumulate(probs, dtype=np.float32)
        j = np.flatnonzero(cum / total >= top_p)
        k_top = int(j[0]) + 1 if j.size else n + 1
    if k_min < k_top:
        return k_min, k_min < n
    return k_top, True if k_top <= n else False


# --------------------------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------------------------


def argmax(logits) -> int:
    """ds4.c sample_argmax (15089-15100): the first index whose logit is maximal.

    Exactly like ds4 the search starts from DS4_NEG_INF = -1e30 with a strict ``>``: NaN is never chosen,
    +inf is, and if no logit exceeds -1e30 the answer is token 0.
    """
    a = _as_logits(logits)
    with np.errstate(invalid="ignore"):
        w = np.where(a > _NEG_INF32, a, np.float32(-np.inf))
    return int(np.argmax(w))


def argmax_on_device(xp, logits, exclude=None):
    """:func:`argmax`'s choice for each row of ``logits`` (a backend's array) with the ids ``exclude`` (an int array on
    the same device) at -inf, as int32 on the device: the next greedy token picked where the logits are (an excluded
    id only as argmax's token 0 when no logit is above -1e30)."""
    w = xp.where(logits > _NEG_INF32, logits, np.float32(-np.inf))
    if exclude is not None and exclude.size:
        w[..., exclude] = -np.inf
    return xp.argmax(w, axis=-1).astype(xp.int32)


def exclude_mask(exclude, vocab: int) -> np.ndarray:
    """The ids ``exclude`` as bits, int32 words ``[ceil(vocab / 32)]`` (bit i % 32 of word i // 32 for id i): how
    the ``next_token`` kernel reads them."""
    ids = np.asarray(exclude, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(f"exclude: ids must be in [0, {vocab}), got {ids.min()}..{ids.max()}")
    words = np.zeros(-(-vocab // 32), dtype=np.uint32)
    np.bitwise_or.at(words, ids // 32, np.left_shift(np.uint32(1), (ids % 32).astype(np.uint32)))
    return words.view(np.int32)


def draw_params(u, temperature, min_p) -> np.ndarray:
    """``[temperature, min_rel, u]`` as float32, the ``next_token`` kernel's draw (:func:`sample_on_device`'s rule
    and parameters: min_rel is min_p where positive, else 0)."""
    t, mp = _as_f32("temperature", temperature), _as_f32("min_p", min_p)
    return np.array([t, mp if mp > 0 else _F32_ZERO, np.float32(u)], dtype=np.float32)


def weighted_rule(temperature, top_k, top_p) -> bool:
    """Whether these parameters are ones for which :func:`sample_on_device` draws what :func:`sample` draws: rule 2
    with a positive finite temperature, no top_k and no top_p cut (ds4's defaults). False for anything else,
    parameters :func:`sample` refuses included (it says why when it runs)."""
    try:
        t, tp, k = _as_f32("temperature", temperature), _as_f32("top_p", top_p), operator.index(top_k)
    except TypeError:
        return False
    return bool(np.isfinite(t) and t > 0 and k <= 0 and (tp <= 0 or tp >= 1))


def sample_on_device(xp, logits, u, temperature, min_p, exclude=None):
    """:func:`sample`'s rule 2 (:func:`weighted_rule`) for the row ``logits [1, vocab]`` (a backend's array) with the
    ids ``exclude`` (on the same device) at -inf, and ``u`` the uniform draw the host will make
    (``np.float32(rng.uniform())``): the token as int32 ``[1]`` on the device. Its operations are the host's: the
    weights through float64 exp rounded to float32, sums as running sums, the draw loop as a running sum from r;
    over NumPy it is bit for bit :func:`sample`, elsewhere a library's parallel sums may round a token at a boundary
    differently."""
    t, mp = _as_f32("temperature", temperature), _as_f32("min_p", min_p)
    min_rel = mp if mp > 0 else _F32_ZERO
    a = logits.reshape(-1)
    if exclude is not None and exclude.size:
        a = a.copy()
        a[exclude] = -np.inf
    finite = xp.isfinite(a)
    some = xp.any(finite)
    finite_only = xp.where(finite, a, -np.inf)
    # the token when nothing is drawn: the first maximal finite logit above -1e30 (else 0); argmax when none is finite
    best = xp.where(some, argmax_on_device(xp, finite_only[None])[0], argmax_on_device(xp, a[None])[0])
    max_logit = xp.maximum(xp.max(finite_only), _NEG_INF32).astype(xp.float32)
    with np.errstate(over="ignore", under="ignore", invalid="ignore", divide="ignore"):
        z = xp.where(finite, (a - max_logit) / t, np.float32(-np.inf))
        w = xp.exp(z.astype(xp.float64)).astype(xp.float32)
        kept = finite & ~(w < min_rel)
        w = xp.where(kept, w, _F32_ZERO)  # a dropped weight adds 0 to the sums
        total = xp.cumsum(w, dtype=xp.float32)[-1]
        r = (np.float32(u) * total).astype(xp.float32)
        walk = xp.cumsum(xp.concatenate([r[None], -w]), dtype=xp.float32)[1:]  # r − p0 − p1 − …
    hit = (walk <= 0) & kept
    drawn = xp.argmax(hit)  # the first kept position where the walk reaches 0
    ok = (total > 0) & xp.isfinite(total) & hit[drawn] & some
    return xp.where(ok, drawn, best).astype(xp.int32)[None]


def sample(
    logits,
    temperature: float = DEFAULT_TEMPERATURE,
    top_k: int = DEFAULT_TOP_K,
    top_p: float = DEFAULT_TOP_P,
    min_p: float = DEFAULT_MIN_P,
    rng: Rng | None = None,
) -> int:
    """Pick the next token like ds4's ``ds4_session_sample`` (ds4.c:17639 -> sample_top_p_min_p, 15238).

    Rules (docs/MODEL.md, "Sampling"), in ds4's order:

    1. ``temperature <= 0`` -> :func:`argmax` (no RNG draw).  Then out-of-range parameters are fixed:
       ``top_p`` not in (0, 1] -> 1; ``min_p < 0`` -> 0; ``top_k > 1024`` -> 1024; ``top_k > vocab`` -> vocab.
    2. ``top_k <= 0`` and ``top_p >= 1``: weights ``w = expf((l - max)/T)`` over the finite logits, drop
       ``w < min_p``, draw ``r = u * sum(w)`` and scan in token-id order.
    3. ``top_k <= 0`` and ``top_p < 1``: all finite tokens sorted by logit (descending, ties by id),
       keep the head while ``p_i >= p_0 * min_p`` (i > 0) and until the kept mass reaches ``top_p`` (the
       crossing token is kept); draw within the head in that order.
    4. ``top_k > 0``: the ``top_k`` largest finite logits (ties by id), then the filter of rule 3 with
       probabilities normalised over those ``top_k`` only.

    At most one value is drawn from ``rng``, and none when ds4 returns without drawing (greedy, or every
    weight filtered out).  ``rng=None`` uses a module-level generator seeded from the clock, as ds4 seeds
    when no seed is given.  NaN parameters are accepted and behave as in ds4 (NaN temperature: the first
    maximal finite logit; NaN top_p: no top_p cut-off but the sorted path; NaN min_p: like 0).
    """
    a = _as_logits(logits)
    t = _as_f32("temperature", temperature)
    tp = _as_f32("top_p", top_p)
    mp = _as_f32("min_p", min_p)
    try:
        k = operator.index(top_k)
    except TypeError:
        raise TypeError(f"top_k must be an integer, got {top_k!r}") from None

    # ds4.c:15246-15248
    if t <= 0:
        return argmax(a)
    if tp <= 0 or tp > 1:
        tp = np.float32(1.0)
    if mp < 0:
        mp = _F32_ZERO

    def draw():
        return np.float32((rng if rng is not None else _get_default_rng()).uniform())

    if k <= 0:
        return _sample_full_vocab(a, t, tp, mp, draw)
    k = min(k, TOP_K_MAX, a.size)
    return _sample_top_k(a, t, k, tp, mp, draw)


def _weight_candidates(vals: np.ndarray, max_logit: np.float32, t: np.float32, min_rel: np.float32) -> np.ndarray:
    """Positions of ``vals`` (finite, at most ``max_logit``) in order, that include every one whose weight
    ``expf((v - max_logit) / t)`` may reach ``min_rel``: the weights are monotone in v, and a v below
    ``max_logit + t·(ln min_rel − 1)`` has a weight under min_rel/e, whatever the float32 roundings (each
    relative, 2^-24). Rule 2 then weighs a few hundred logits, not the vocabulary."""
    if not (min_rel > 0 and np.isfinite(t) and t > 0):
        return np.arange(vals.size)  # no cut (NaN or infinite temperature, no min_p): every position
    with np.errstate(over="ignore", divide="ignore"):
        low = float(max_logit) + float(t) * (np.log(float(min_rel)) - 1.0)
        low32 = np.nextafter(np.float32(low), np.float32(-np.inf))  # rounded down: a superset of positions
    return np.flatnonzero(vals >= low32)


def _sample_full_vocab(a: np.ndarray, t: np.float32, tp: np.float32, mp: np.float32, draw) -> int:
    """ds4.c sample_full_vocab (15149-15236)."""
    ids, vals = _finite(a)
    if vals.size == 0:
        return argmax(a)
    # max_logit starts at DS4_NEG_INF (-1e30) and `best` at 0; strict `>` so the first maximal index wins.
    i_best = int(np.argmax(vals))
    if vals[i_best] > _NEG_INF32:
        max_logit, best = vals[i_best], int(ids[i_best])
    else:
        max_logit, best = _NEG_INF32, 0

    min_rel = mp if mp > 0 else _F32_ZERO  # NaN min_p -> 0

    if tp >= 1:
        # Rule 2: id order.  `if (p < min_rel) continue;` (a NaN weight is not skipped, and poisons the sum).
        cand = _weight_candidates(vals, max_logit, t, min_rel)
        probs = _weights(vals[cand], max_logit, t)
        keep = ~(probs < min_rel)
        kept_ids = ids[cand[keep]]
        kept = probs[keep]
        total = _seq_sum(kept)
        if total <= 0 or not np.isfinite(total):
            return best  # e.g. min_p > 1 filters everything: no draw
        r = draw() * total
        i = _scan(r, kept)
        return int(kept_ids[i]) if i >= 0 else best

    # Rule 3: the sum runs over *all* finite tokens in id order, before sorting and filtering.
    probs = _weights(vals, max_logit, t)
    total = _seq_sum(probs)
    if total <= 0 or not np.isfinite(total):
        return best
    # The sorted head: probabilities are non-increasing along the logit order (float subtraction, division by
    # T > 0, expf and division by the sum are all monotone), so the tokens passing `p >= min_prob` form a
    # prefix of that order and the first failing one ends the loop.  Only that prefix needs sorting.
    order0 = i_best  # cand[0]: the first maximal finite logit
    with np.errstate(invalid="ignore", over="ignore"):
        min_prob = (probs[order0] / total) * min_rel
        passing = ~(probs / total < min_prob)
    passing[order0] = True
    pool = np.flatnonzero(passing)  # positions into vals, id order
    pool_vals = vals[pool]

    m = 2048
    while True:
        sel = pool[_top_sorted(pool_vals, m)] if m < pool.size else pool[np.argsort(-pool_vals, kind="stable")]
        sel_probs = probs[sel]
        filtered, stopped = _filter(sel_probs, total, min_prob, tp)
        if stopped or sel.size == pool.size:
            break
        m *= 8
    r = draw() * _seq_sum(sel_probs[:filtered])
    i = _scan(r, sel_probs[:filtered])
    return int(ids[sel[i if i >= 0 else filtered - 1]])


def _sample_top_k(a: np.ndarray, t: np.float32, k: int, tp: np.float32, mp: np.float32, draw) -> int:
    """ds4.c sample_top_p_min_p, top_k > 0 branch (15250-15298)."""
    ids, vals = _finite(a)
    if vals.size == 0:
        return argmax(a)
    sel = ids[_top_sorted(vals, k)]  # ids[0..n): top-k by logit, ties by lower id
    sel_vals = a[sel]
    probs = _weights(sel_vals, sel_vals[0], t)  # max_logit = vals[0] (no -1e30 floor on this path)
    total = _seq_sum(probs)  # summed in sorted order on this path
    if total <= 0 or not np.isfinite(total):
        return int(sel[0])
    with np.errstate(invalid="ignore", over="ignore"):
        min_prob = (probs[0] / total) * mp  # NaN min_p -> NaN -> `p < min_prob` never true
    filtered, _ = _filter(probs, total, min_prob, tp)
    r = draw() * _seq_sum(probs[:filtered])
    i = _scan(r, probs[:filtered])
    return int(sel[i if i >= 0 else filtered - 1])


def _logsumexp_ds4(finite_vals: np.ndarray) -> float:
    """``max_logit + log(sum(exp((double)v - (double)max_logit)))`` over the finite logits (in id order),
    sequential double sum.

    max_logit starts at DS4_NEG_INF (-1e30), as in ds4.c:17652 / 17683.
    """
    x = finite_vals.astype(np.float64)
    max_logit = max(float(_NEG_INF32), float(x.max())) if x.size else float(_NEG_INF32)
    with np.errstate(over="ignore", under="ignore", divide="ignore"):
        # in place, one array of the vocabulary's size (twice as fast at 129,280 as three of them)
        np.subtract(x, max_logit, out=x)
        np.exp(x, out=x)
        s = float(np.add.accumulate(x, out=x)[-1]) if x.size else 0.0
        return max_logit + (float(np.log(s)) if s > 0 else -np.inf)


def _logprob(logit: np.float32, logsum: float) -> float:
    if not np.isfinite(logit):
        return NEG_INF
    with np.errstate(over="ignore"):
        return float(np.float32(float(logit) - logsum))  # (float)((double)logit - logsum)


def top_logprobs(logits, k: int) -> list[tuple[int, float]]:
    """ds4.c ds4_session_top_logprobs (17643-17680): the ``k`` largest finite logits with their log-probability.

    Order: logit descending, ties by lower id.  Non-finite logits are neither listed nor summed.  The
    log-sum-exp is a sequential double sum shifted by the largest finite logit; each logprob is rounded to
    float32 as ds4 stores it.  ``k <= 0`` gives ``[]``; fewer than ``k`` entries come back when fewer logits
    are finite (ds4 pads those slots with id -1).
    """
    a = _as_logits(logits)
    k = operator.index(k)
    if k <= 0:
        return []
    ids, vals = _finite(a)
    return _top(a, ids, vals, k, _logsumexp_ds4(vals)) if vals.size else []


def _top(a: np.ndarray, ids: _Ids, vals: np.ndarray, k: int, logsum: float) -> list[tuple[int, float]]:
    return [(int(i), _logprob(a[i], logsum)) for i in ids[_top_sorted(vals, min(k, a.size))]]


def token_logprob(logits, token: int) -> float:
    """ds4.c ds4_session_token_logprob (17680-17700): the log-probability of ``token``.

    A token whose logit is not finite gets ds4's DS4_NEG_INF (-1e30, see :data:`NEG_INF`), not -inf.
    """
    a = _as_logits(logits)
    token = _token_index(token, a.size)
    return _logprob(a[token], _logsumexp_ds4(_finite(a)[1]))


def token_and_top_logprobs(logits, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """``(token_logprob(logits, token), top_logprobs(logits, k))`` with one log-sum-exp between them (what a
    decode step reports: at Flash's vocabulary the sum is most of the cost of each)."""
    a = _as_logits(logits)
    token, k = _token_index(token, a.size), operator.index(k)
    ids, vals = _finite(a)
    logsum = _logsumexp_ds4(vals)
    return _logprob(a[token], logsum), (_top(a, ids, vals, k, logsum) if vals.size and k > 0 else [])


def _token_index(token, n_vocab: int) -> int:
    token = operator.index(token)
    if token < 0 or token >= n_vocab:
        raise ValueError(f"token {token} out of range for a vocabulary of {n_vocab}")
    return token
