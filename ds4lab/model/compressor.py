"""The KV compressor: pool every R tokens into one row (spec §3.6).

Used twice per compressed layer: for attention rows (D = head_dim) and, in ratio-4 layers, for the
indexer's rows (D = idx_dim). Each token projects ``kv`` and a gate score ``sc`` (the APE is added to the
score only, indexed by the position inside its window); a window's row is a per-channel softmax over
its candidates' scores of their kv values.

Ratio 128: the candidates are the window's 128 tokens. Ratio 4 overlaps: the projections are 2·D wide
and window w pools the first halves of window w−1's tokens with the second halves of window w's
(8 candidates); before window 0 the previous-window candidates are masked (score −1e30).

The pending state has ds4's fixed layout (spec/DS4_RUNTIME.md §2.4): ``coff·R`` rows, for ratio 4 the
previous window's 4 rows then the current window's 4 (slot = position mod 4), for ratio 128 the
current window's 128; slots not yet written hold (kv 0, score −1e30).

A chunk is processed with fixed shapes so that its start position can be a traced input: the state's
rows and the chunk's rows are laid out on a timeline of whole windows, every window of the timeline is
pooled, and the caller keeps only the windows that completed inside the chunk.
"""

from __future__ import annotations

from .functional import NEG_INF, softmax


def coff(ratio: int) -> int:
    return 2 if ratio == 4 else 1


def initial_state(backend, ratio: int, width: int):
    xp = backend.xp
    rows = coff(ratio) * ratio
    return xp.zeros((rows, width), dtype=backend.dtype), xp.full((rows, width), NEG_INF, dtype=backend.dtype)


def n_blocks(ratio: int, chunk: int) -> int:
    """Windows on the timeline of a chunk: the state's windows plus every window the chunk can touch."""
    return coff(ratio) + chunk // ratio + 1


def compress_chunk(xp, state_kv, state_sc, kv, sc, pos0, n_valid, ratio: int):
    """Pool the windows of the timeline ``state ∥ chunk``; returns ``(pooled, new_kv, new_sc)``.

    ``kv``/``sc`` are ``[C, W]`` for positions ``pos0 …`` of which the first ``n_valid`` are real.
    ``pooled[k]`` is window ``pos0 // R + k``; only windows ending before ``pos0 + n_valid`` are complete.
    """
    R, c = ratio, coff(ratio)
    C, W = kv.shape
    nb = n_blocks(R, C)
    start = (c - 1) * R + pos0 % R  # timeline index of the chunk's first row
    j = xp.arange(nb * R)
    src = xp.where(j < start, j, c * R + j - start)
    src = xp.minimum(src, c * R + C - 1)
    blocks_kv = xp.concatenate([state_kv, kv], axis=0)[src].reshape(nb, R, W)
    blocks_sc = xp.concatenate([state_sc, sc], axis=0)[src].reshape(nb, R, W)

    if R == 4:
        half = W // 2
        cand_kv = xp.concatenate([blocks_kv[:-1, :, :half], blocks_kv[1:, :, half:]], axis=1)
        cand_sc = xp.concatenate([blocks_sc[:-1, :, :half], blocks_sc[1:, :, half:]], axis=1)
    else:
        cand_kv, cand_sc = blocks_kv, blocks_sc
    pooled = (softmax(xp, cand_sc, axis=1) * cand_kv).sum(axis=1)

    # The new state: the window the next token falls in (and, for ratio 4, the one before it),
    # with the slots after the last real token cleared.
    end = pos0 + n_valid
    current = end // R - pos0 // R + (c - 1)  # block index of the window holding position `end`
    keep = current - (c - 1) + xp.arange(c)
    new_kv = blocks_kv[keep].reshape(c * R, W)
    new_sc = blocks_sc[keep].reshape(c * R, W)
    filled = (xp.arange(c * R) < (c - 1) * R + end % R)[:, None]
    return pooled, xp.where(filled, new_kv, 0.0), xp.where(filled, new_sc, NEG_INF)

