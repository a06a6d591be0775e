"""Mixture of experts: sqrt-softplus router, hash or top-k selection, clamped SwiGLU experts
(docs/MODEL.md, "Mixture of experts")."""

from __future__ import annotations

import numpy as np

from ..arch import ROUTER_SUM_FLOOR
from .functional import silu, softplus


def router_probs(xp, logits):
    return xp.sqrt(softplus(xp, logits))


def select_topk(scores: np.ndarray, k: int) -> np.ndarray:
    """Top-k expert ids per row in descending score, ties toward the lower id (a stable sort)."""
    return np.argsort(-scores, axis=-1, kind="stable")[:, :k]


def select_topk_on_device(xp, scores, k: int):
    """:func:`select_topk` without leaving the device, for a few rows: an expert's rank is the number of
    experts that come before it (a higher score, or an equal one and a lower id), so the ranks are
    distinct and slot r takes the expert ranked r. No sort: a library's sort may wait for the GPU, which
    a CUDA graph capture does not allow."""
    n = scores.shape[-1]
    s_i, s_j = scores[:, :, None], scores[:, None, :]
    lower_id = xp.arange(n)[None, :] < xp.arange(n)[:, None]  # [i, j]: j < i
    rank = ((s_j > s_i) | ((s_j == s_i) & lower_id)).astype(xp.int32).sum(axis=-1)
    return (rank[:, None, :] == xp.arange(k)[:, None]).astype(xp.int32).argmax(axis=-1)


def route_weights(xp, probs, selected, scale: float):
    """w_i = p[sel_i] / max(Σ_j p[sel_j], 2^-14) · scale, from the unbiased probabilities."""
    p = xp.take_along_axis(probs, selected, axis=-1)
    return p / xp.maximum(p.sum(axis=-1, keepdims=True), ROUTER_SUM_FLOOR) * scale


def swiglu(xp, gate, up, clamp: float):
    """The gate is clamped only from above, up on both sides."""
    return silu(xp, xp.minimum(gate, clamp)) * xp.clip(up, -clamp, clamp)


def routed_experts(ops, f, selected: np.ndarray, weights, experts, clamp: float):
    """Σ over each token's selected experts of w·down(swiglu(gate·f, up·f)).

    ``experts(e)`` returns the (gate, up, down) linears of expert e, built on demand from the GGUF
    blocks of that expert only. The route weight multiplies ``mid`` before the down projection. ``ops``:
    a :class:`ds4lab.ops.Ops` (its ``xp``, ``dtype``, ``asarray`` and ``index_add``; a backend has them too).
    """
    xp = ops.xp
    out = xp.zeros(f.shape, dtype=ops.dtype)
    for e in np.unique(selected):
        hit = selected == e
        rows = np.nonzero(hit.any(axis=1))[0]
        w = (weights * ops.asarray(hit)).sum(axis=1)[xp.array(rows)]
        gate, up, down = experts(int(e))
        x = f[xp.array(rows)]
        out = ops.index_add(out, rows, down(swiglu(xp, gate(x), up(x), clamp) * w[:, None]))
    return out


def routed_experts_gathered(ops, f, selected, weights, stacked, clamp: float, quiet: bool = False):
    """The same experts' outputs with every (token, expert) pair in one product per projection: each token's k
    rows ``[T·k, E]``, their sum per token the MoE's output (``ops.pair_sum``, or ``ops.hc_post`` adding them).

    ``stacked`` is (gate, up, down), each called as ``proj(x, experts, repeat)`` with row p // repeat of
    ``x`` multiplied by expert ``experts[p]`` (gate and up through ``ops.split_sums``: swiglu adds their K splits);
    pairs are token-major, as ``selected`` is, which may be a host array or a device one. The SwiGLU and the
    route weights are ``ops.swiglu`` of a :class:`ds4lab.ops.Ops` (a kernel where the backend has it); with
    ``quiet`` (no observer), ``ops.branch`` may run the up projection beside the gate.
    """
    T, k = selected.shape
    experts = selected.reshape(-1)  # host ids, or ids that never left the device (a decode step)
    gate, up, down = stacked
    up_side = ops.branch(T, quiet)  # for a decode step, up's launch beside gate's: neither fills the GPU alone
    with up_side:
        u = ops.split_sums(up, f, experts, k)  # swiglu adds the K splits
    g = ops.split_sums(gate, f, experts, k)
    up_side.join()
    mid = ops.swiglu(g, u, clamp, weights.reshape(T * k))
    return down(mid, experts)
