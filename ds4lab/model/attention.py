"""Attention: visibility, the indexer's row selection, softmax with sinks, grouped output
(docs/MODEL.md, "Attention")."""

from __future__ import annotations

import numpy as np

from .functional import topk_mask


def raw_visibility(xp, q_pos, k_pos, window: int):
    """Raw key at position k is visible to query q iff q − window < k ≤ q (k < 0: an empty slot)."""
    q, k = q_pos[:, None], k_pos[None, :]
    return (k >= 0) & (k <= q) & (k > q - window)


def ring_write(xp, raw, kv, pos0, n_valid, window: int):
    """The raw ring ``[raw_cap, D]`` after a chunk ``kv [C, D]`` at positions ``pos0 …`` of which ``n_valid`` are
    real: ``(raw, slot_pos, visible)``. Slot s holds the latest position ≡ s (mod raw_cap) before
    ``pos0 + n_valid``, ``slot_pos[s]`` (negative while none was written), taken from the chunk where it is
    one of its rows; ``visible [C, raw_cap]`` is :func:`raw_visibility` of every row's query."""
    raw_cap, C = raw.shape[0], kv.shape[0]
    end = pos0 + n_valid
    slot_pos = (end - 1) - ((end - 1 - xp.arange(raw_cap)) % raw_cap)
    written = slot_pos >= pos0
    raw = xp.where(written[:, None], kv[xp.clip(slot_pos - pos0, 0, C - 1)], raw)
    return raw, slot_pos, raw_visibility(xp, pos0 + xp.arange(C), slot_pos, window)


def visible_rows(q_pos, ratio: int):
    """How many compressed rows query q sees: row c iff (c+1)·R ≤ q+1, i.e. c < floor((q+1)/R)."""
    return (q_pos + 1) // ratio


def compressed_visible(xp, pos0, n_valid, C: int, n_rows: int, ratio: int):
    """``(n_vis [C], visible [C, n_rows])``: how many compressed rows each query of a chunk sees, and which, before
    the indexer chooses among them."""
    last = xp.minimum(pos0 + xp.arange(C), pos0 + n_valid - 1)  # padded queries look like the last real one
    n_vis = visible_rows(last, ratio)
    return n_vis, xp.arange(n_rows)[None, :] < n_vis[:, None]


def join_tail(xp, keys, visible, tail):
    """``keys`` and ``visible`` with ``tail`` = (keys2, visible2), the keys that follow them, joined (None: as
    they are)."""
    if tail is None:
        return keys, visible
    return xp.concatenate([keys, tail[0]], axis=0), xp.concatenate([visible, tail[1]], axis=1)


def indexer_scores(xp, q_idx, w_idx, k_idx):
    """score[t, c] = Σ_h relu(q_idx[t,h]·k_idx[c]) · w_idx[t,h]."""
    T, H, D = q_idx.shape
    dots = (q_idx.reshape(T * H, D) @ k_idx.T).reshape(T, H, -1)
    return (xp.maximum(dots, 0.0) * w_idx[:, :, None]).sum(axis=1)


def indexer_allowed(xp, score, visible, n_visible: np.ndarray, top_k: int):
    """Rows each query may attend: its top-k by score among visible rows when more than k are visible."""
    masked = xp.where(visible, score, -float("inf"))
    selected = topk_mask(xp, masked, top_k)
    return xp.where((n_visible > top_k)[:, None], selected & visible, visible)


def attend(xp, q, keys, visible, sinks, scale: float):
    """Softmax over visible keys plus a per-head sink logit that takes mass but carries no value.

    q [T,H,D], keys [N,D] (keys are also the values), visible [T,N] bool, sinks [H] → [T,H,D].
    """
    T, H, D = q.shape
    # keys no query sees are read as zeros: a compiled step's copy of a state leaves such rows as its memory held them
    # (ds4lab.cuda.graphs), and their zero weights would not cancel a NaN there
    keys = xp.where(xp.any(visible, axis=0)[:, None], keys, 0.0)
    # products as matrix multiplications (BLAS on numpy, whose einsum would loop in C without it)
    s = (q.reshape(T * H, D) @ keys.T).reshape(T, H, -1) * scale
    s = xp.where(visible[:, None, :], s, -float("inf"))
    m = xp.maximum(s.max(axis=-1), sinks[None, :])
    e = xp.exp(s - m[:, :, None])
    den = xp.exp(sinks[None, :] - m) + e.sum(axis=-1)
    return (e.reshape(T * H, -1) @ keys).reshape(T, H, D) / den[:, :, None]


def grouped_output(xp, heads, out_a_groups, out_b):
    """Group g projects heads g·H/G … (g+1)·H/G−1 through its own low-rank slice, then out_b mixes all."""
    T, H, D = heads.shape
    G = len(out_a_groups)
    flat = heads.reshape(T, G, (H // G) * D)
    low = xp.concatenate([out_a_groups[g](flat[:, g, :]) for g in range(G)], axis=-1)
    return out_b(low)


def grouped_output_gathered(xp, heads, stacked, n_groups: int, out_b):
    """The same projection with every (token, group) pair in one product: ``stacked(x_pairs, groups)``
    multiplies row p by group ``groups[p]``'s low-rank slice; pairs are token-major."""
    T, H, D = heads.shape
    flat = heads.reshape(T * n_groups, (H // n_groups) * D)
    low = stacked(flat, np.tile(np.arange(n_groups), T))
    return out_b(low.reshape(T, -1))
