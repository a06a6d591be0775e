"""The KV compressor: pool every R tokens into one row (docs/MODEL.md, "Attention").

Used twice per compressed layer: for attention rows (D = head_dim) and, in ratio-4 layers, for the
indexer's rows (D = idx_dim). Each token projects ``kv`` and a gate score ``sc`` (the APE is added to the
score only, indexed by the position inside its window); a window's row is a per-channel softmax over
its candidates' scores of their kv values.

Ratio 128: the candidates are the window's 128 tokens. Ratio 4 overlaps: the projections are 2·D wide
and window w pools the first halves of window w−1's tokens with the second halves of window w's
(8 candidates); before window 0 the previous-window candidates are masked (score −1e30).

The pending state has ds4's fixed layout (docs/MODEL.md, "Attention"): ``coff·R`` rows, for ratio 4 the
previous window's 4 rows then the current window's 4 (slot = position mod 4), for ratio 128 the
current window's 128; slots not yet written hold (kv 0, score −1e30).

A chunk is processed with fixed shapes so that its start position can be a traced input: the state's
rows and the chunk's rows are laid out on a timeline of whole windows, every window of the timeline is
pooled, and the caller keeps only the windows that completed inside the chunk.
"""

from __future__ import annotations

from ..arch import NEG_INF, coff, n_blocks
from .functional import softmax


def add_ape(xp, gate, ape, pos0):
    """The scores of a chunk at positions ``pos0 …``: the gate's output ``[C, W]`` plus the APE row ``ape [R, W]``
    of each position's slot in its window."""
    return gate + ape[(pos0 + xp.arange(gate.shape[0])) % ape.shape[0]]


def window_start(pos0, ratio: int):
    """Timeline index of a chunk's first row: after the state's earlier windows and ``pos0 mod R`` rows."""
    return (coff(ratio) - 1) * ratio + pos0 % ratio


def _timeline(xp, state, rows, j, start, ratio: int):
    """Rows ``j`` of the timeline ``state ∥ chunk``: state row j before ``start``, chunk row j − start
    after (clamped to the chunk's last row, which only padding windows reach)."""
    c, C = coff(ratio), rows.shape[0]
    src = xp.minimum(xp.where(j < start, j, c * ratio + j - start), c * ratio + C - 1)
    return xp.concatenate([state, rows], axis=0)[src]


def pool_windows(xp, state_kv, state_sc, kv, sc, pos0, ratio: int):
    """``pooled[k]``, the row of window ``pos0 // R + k``, for every window of the chunk's timeline."""
    R = ratio
    C, W = kv.shape
    nb = n_blocks(R, C)
    j, start = xp.arange(nb * R), window_start(pos0, R)
    blocks_kv = _timeline(xp, state_kv, kv, j, start, R).reshape(nb, R, W)
    blocks_sc = _timeline(xp, state_sc, sc, j, start, R).reshape(nb, R, W)
    if R == 4:
        half = W // 2
        cand_kv = xp.concatenate([blocks_kv[:-1, :, :half], blocks_kv[1:, :, half:]], axis=1)
        cand_sc = xp.concatenate([blocks_sc[:-1, :, :half], blocks_sc[1:, :, half:]], axis=1)
    else:
        cand_kv, cand_sc = blocks_kv, blocks_sc
    return (softmax(xp, cand_sc, axis=1) * cand_kv).sum(axis=1)


def next_state(xp, state_kv, state_sc, kv, sc, pos0, n_valid, ratio: int):
    """The pending state after the chunk: the window the next token falls in (and, for ratio 4, the one
    before it), with the slots after the last real token cleared."""
    R, c = ratio, coff(ratio)
    end = pos0 + n_valid
    j = (end // R - pos0 // R) * R + xp.arange(c * R)  # the timeline rows of those windows
    start = window_start(pos0, R)
    new_kv, new_sc = _timeline(xp, state_kv, kv, j, start, R), _timeline(xp, state_sc, sc, j, start, R)
    filled = (xp.arange(c * R) < (c - 1) * R + end % R)[:, None]
    return xp.where(filled, new_kv, 0.0), xp.where(filled, new_sc, NEG_INF)


def compress_chunk(xp, state_kv, state_sc, kv, sc, pos0, n_valid, ratio: int):
    """Pool the windows of the timeline ``state ∥ chunk``; returns ``(pooled, new_kv, new_sc)``.

    ``kv``/``sc`` are ``[C, W]`` for positions ``pos0 …`` of which the first ``n_valid`` are real.
    ``pooled[k]`` is window ``pos0 // R + k``; only windows ending before ``pos0 + n_valid`` are complete.
    """
    return (pool_windows(xp, state_kv, state_sc, kv, sc, pos0, ratio),
            *next_state(xp, state_kv, state_sc, kv, sc, pos0, n_valid, ratio))


def append_rows(xp, rows, pooled, pos0, n_valid, ratio: int):
    """The compressed rows after a chunk: row ``pos0 // R + k`` becomes ``pooled[k]`` for every window that
    ended inside the chunk; the other rows are kept."""
    r = xp.arange(rows.shape[0])
    k = r - pos0 // ratio  # pooled[k] is window pos0 // R + k
    emitted = (k >= 0) & (r < (pos0 + n_valid) // ratio)
    return xp.where(emitted[:, None], pooled[xp.clip(k, 0, pooled.shape[0] - 1)], rows)
