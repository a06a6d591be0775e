"""The KV compressor: pool every R tokens into one row (spec §3.6).

Used twice per compressed layer: for attention rows (D = head_dim) and, in ratio-4 layers, for the
indexer's rows (D = idx_dim). Each token projects ``kv`` and a gate score ``sc`` (the APE is added to the
score only, indexed by the position inside its window); a window's row is a per-channel softmax over
its candidates' scores of their kv values.

Ratio 128: the candidates are the window's 128 tokens. Ratio 4 overlaps: the projections are 2·D wide
and window w pools the first halves of window w−1's tokens with the second halves of window w's
(8 candidates); before window 0 there is a virtual window of masked candidates.

A chunk of tokens is processed at once: the pending rows of the unfinished window (and, for ratio 4,
the previous window) are prepended, every window completed inside the chunk is pooled in bulk, and
the rows of the windows still open are kept as the new pending state.
"""

from __future__ import annotations

from dataclasses import dataclass

from .functional import NEG_INF, softmax


@dataclass
class CompressorState:
    """Projected rows of the windows still needed, starting at window ``start_window`` (−1 = virtual)."""

    kv: object  # [n, W]
    sc: object  # [n, W]
    start_window: int


def initial_state(backend, ratio: int, width: int) -> CompressorState:
    if ratio == 4:
        xp = backend.xp
        return CompressorState(xp.zeros((ratio, width), dtype=backend.dtype),
                               xp.full((ratio, width), NEG_INF, dtype=backend.dtype), -1)
    return CompressorState(backend.xp.zeros((0, width), dtype=backend.dtype),
                           backend.xp.zeros((0, width), dtype=backend.dtype), 0)


def compress(xp, state: CompressorState, kv, sc, end_pos: int, ratio: int):
    """Append the chunk's ``kv``/``sc`` rows (ending before ``end_pos``) and pool completed windows.

    Returns ``(pooled [n_new, D], first_new_window, new_state)``.
    """
    KV = xp.concatenate([state.kv, kv], axis=0)
    SC = xp.concatenate([state.sc, sc], axis=0)
    width = KV.shape[1]
    n_done = end_pos // ratio  # windows complete after this chunk
    n_complete = n_done - state.start_window  # complete windows held in KV
    if ratio == 4:
        half = width // 2
        first_new = state.start_window + 1
        n_new = max(0, n_complete - 1)
        keep_from = max(state.start_window, n_done - 1)
    else:
        first_new = state.start_window
        n_new = max(0, n_complete)
        keep_from = max(state.start_window, n_done)
    offset = (keep_from - state.start_window) * ratio
    new_state = CompressorState(KV[offset:], SC[offset:], keep_from)
    if n_new == 0:
        return None, first_new, new_state

    blocks_kv = KV[: n_complete * ratio].reshape(n_complete, ratio, width)
    blocks_sc = SC[: n_complete * ratio].reshape(n_complete, ratio, width)
    if ratio == 4:
        cand_kv = xp.concatenate([blocks_kv[:-1, :, :half], blocks_kv[1:, :, half:]], axis=1)
        cand_sc = xp.concatenate([blocks_sc[:-1, :, :half], blocks_sc[1:, :, half:]], axis=1)
    else:
        cand_kv, cand_sc = blocks_kv, blocks_sc
    pooled = (softmax(xp, cand_sc, axis=1) * cand_kv).sum(axis=1)
    return pooled, first_new, new_state
