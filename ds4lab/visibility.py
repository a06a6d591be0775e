"""Which keys each query of one step (a prefill chunk or a decode step) of one layer can see, by the model's own
rules (:mod:`ds4lab.model.attention`: ``ring_write`` / ``raw_visibility`` for the raw window,
``compressed_visible`` for compressed rows; the indexer's choice is what ``indexer_allowed`` returned, read from a
capture of ``indexer.topk``). :func:`step_mask` returns a :class:`StepMask`: the key columns grouped as
raw rows cached by earlier steps | the step's own raw rows | compressed rows | sink, and a category per cell."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import is_int
from .model.attention import compressed_visible, ring_write

# a cell's category: why key k is or is not seen by query q (the mask view's colours and tooltips)
FUTURE = 0  # a raw row after q (the causal triangle's upper half)
OUTSIDE = 1  # a raw row at or before q − window: out of the raw window
CACHED = 2  # a raw row written by an earlier step, inside the window
OWN = 3  # a raw row of this step, at or before q
NOT_YET = 4  # a compressed row whose group of R tokens ends after q
KEPT = 5  # a compressed row q attends (every visible row, or one the indexer kept)
DROPPED = 6  # a visible compressed row the indexer left out
UNKNOWN = 7  # a visible compressed row; the indexer keeps its top-k of them (which ones: not captured)
SINK = 8  # the per-head sink logit: takes mass, carries no value
CATEGORIES = ("future", "outside the window", "cached", "own", "not yet compressed", "kept", "dropped by the indexer",
              "indexer candidate", "sink")


@dataclass(frozen=True)
class StepMask:
    """The keys of one step of one layer: ``raw_positions`` (the ring's rows some query of the step sees,
    ascending; ``raw_slots`` their ring slots), ``comp_rows`` (the compressed rows existing after the step), and
    ``cells [Q, n_raw + n_comp + 1]`` of categories (the last column the sink)."""

    layer: int
    ratio: int
    window: int
    raw_cap: int
    top_k: int | None  # the indexer's k on a layer with an indexer
    queries: np.ndarray
    raw_positions: np.ndarray
    raw_slots: np.ndarray
    ring_positions: np.ndarray  # position held by each slot after the step (negative: never written)
    comp_rows: np.ndarray
    candidates: np.ndarray  # [Q, n_comp]: compressed rows each query could see before the indexer
    selected: np.ndarray | None  # [Q, n_comp]: those it attends; None where the indexer chose and was not captured
    cells: np.ndarray

    @property
    def pos0(self) -> int:
        return int(self.queries[0])

    @property
    def n_own(self) -> int:
        return int((self.raw_positions >= self.pos0).sum())

    @property
    def seen(self) -> np.ndarray:
        """``[Q, n_raw + n_comp + 1]`` bool: the keys each query attends (sink included; an uncaptured indexer
        candidate counts as unseen)."""
        return np.isin(self.cells, (CACHED, OWN, KEPT, SINK))


def _raw_keys(config, geometry, pos0: int, n: int):
    """``(slot_pos, raw_vis, slots)`` of a step: the position each ring slot holds after it, which slots each query
    sees, and the slots some query sees, by position (a mask's raw columns)."""
    _, slot_pos, raw_vis = ring_write(np, np.zeros((geometry.raw_cap, 1)), np.zeros((n, 1)), pos0, n, config.swa)
    slot_pos, raw_vis = np.asarray(slot_pos), np.asarray(raw_vis)
    slots = np.nonzero(raw_vis.any(axis=0))[0]
    return slot_pos, raw_vis, slots[np.argsort(slot_pos[slots])]


def key_groups(config, geometry, layer: int, pos0: int, n: int) -> list[int]:
    """``[cached raw rows, own rows, compressed rows, queries]`` of :func:`step_mask`'s mask of the same step: its
    columns before the sink by group, and its rows, without making its cells (a view plans its drawing with them)."""
    slot_pos, _, slots = _raw_keys(config, geometry, pos0, n)
    own = int((slot_pos[slots] >= pos0).sum())
    R = config.ratio(layer)
    return [len(slots) - own, own, (pos0 + n) // R if R else 0, n]


def step_mask(config, geometry, layer: int, pos0: int, n: int, selected=None) -> StepMask:
    """The mask of the step evaluating positions ``pos0 … pos0+n−1`` of ``layer``. ``selected`` is the capture of
    ``blk.{layer}.indexer.topk`` for this step (``[n, rows]`` bool), needed to tell kept rows from dropped ones
    where a query sees more than the indexer's top-k."""
    config.check_layer(layer)
    for name, value in (("pos0", pos0), ("n", n)):
        if not is_int(value):
            raise TypeError(f"{name} must be an integer, got {value!r}")
    if n < 1 or pos0 < 0 or pos0 + n > geometry.ctx:
        raise ValueError(f"a step needs n ≥ 1 tokens at pos0 ≥ 0 within the context of {geometry.ctx}, got "
                         f"pos0={pos0}, n={n}")
    q = pos0 + np.arange(n)
    slot_pos, raw_vis, slots = _raw_keys(config, geometry, pos0, n)
    k = slot_pos[slots]
    raw = np.where(raw_vis[:, slots], np.where(k[None, :] < pos0, CACHED, OWN),
                   np.where(k[None, :] > q[:, None], FUTURE, OUTSIDE))
    R = config.ratio(layer)
    n_rows = (pos0 + n) // R if R else 0
    top_k = config.idx_topk if R and config.has_indexer(layer) else None
    if R:
        n_vis, cand = (np.asarray(a) for a in compressed_visible(np, pos0, n, n, n_rows, R))
    else:
        n_vis, cand = np.zeros(n, int), np.zeros((n, 0), bool)
    chooses = top_k is not None and bool((n_vis > top_k).any())
    if selected is not None and top_k is not None:
        sel = np.asarray(selected, bool)
        if sel.shape[0] != n or sel.shape[1] < n_rows:
            raise ValueError(f"indexer selection of shape {sel.shape} does not cover {n} queries × {n_rows} rows")
        sel = sel[:, :n_rows]
        if (sel & ~cand).any():
            raise ValueError("the indexer selection keeps a row no query of this step can see")
    else:
        sel = None if chooses else cand
    comp = np.where(~cand, NOT_YET, KEPT if sel is not None else UNKNOWN)
    if sel is not None:
        comp = np.where(cand & ~sel, DROPPED, comp)
    elif chooses:  # rows of queries that see no more than k are all kept, whatever the capture
        comp = np.where(cand & (n_vis <= top_k)[:, None], KEPT, comp)
    cells = np.concatenate([raw, comp, np.full((n, 1), SINK)], axis=1).astype(np.int8)
    return StepMask(layer, R, config.swa, geometry.raw_cap, top_k, q, k.astype(np.int64), slots.astype(np.int64),
                    slot_pos.astype(np.int64), np.arange(n_rows), cand, sel, cells)
