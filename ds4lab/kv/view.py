"""Read-only NumPy views of a session's KV state, layer by layer, in logical order."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import ModelConfig
from ..text_table import aligned
from .payload import LayerPayload, Payload, payload_nbytes


@dataclass(frozen=True)
class LayerKV:
    layer: int
    ratio: int
    raw: np.ndarray  # [window rows, head_dim]: the raw rows of positions raw_positions
    raw_positions: np.ndarray
    comp: np.ndarray | None  # [⌊T/R⌋, head_dim]; row w pools positions wR … wR+R−1 (ratio 4: from wR−4)
    comp_pending: tuple[np.ndarray, np.ndarray] | None  # (kv, score) of the unfinished window(s)
    index: np.ndarray | None  # [⌊T/4⌋, idx_dim]
    index_pending: tuple[np.ndarray, np.ndarray] | None

    @property
    def n_comp(self) -> int:
        return 0 if self.comp is None else len(self.comp)

    @property
    def n_index(self) -> int:
        return 0 if self.index is None else len(self.index)

    @property
    def nbytes(self) -> int:
        """Bytes this layer takes in the ``DSV4`` payload."""
        arrays = [self.raw, self.comp, self.index, *(self.comp_pending or ()), *(self.index_pending or ())]
        return sum(a.nbytes for a in arrays if a is not None)


class KVView:
    """``sess.kv``: per-layer views (``kv[il]``), counts and byte accounting of the live state."""

    def __init__(self, config: ModelConfig, payload: Payload):
        self.config = config
        self.n_tokens = payload.n_tokens
        start = self.n_tokens - payload.raw_live
        self.layers = [_layer(il, config.ratio(il), saved, start) for il, saved in enumerate(payload.layers)]
        self.nbytes = payload_nbytes(config, self.n_tokens, raw_window=payload.raw_window, raw_cap=payload.raw_cap)

    def __getitem__(self, il: int) -> LayerKV:
        return self.layers[il]

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self):
        return iter(self.layers)

    def __repr__(self) -> str:
        rows = [(lk.layer, lk.ratio, len(lk.raw), lk.n_comp, lk.n_index, f"{lk.nbytes:,}") for lk in self.layers]
        head = ("layer", "ratio", "raw", "comp", "index", "bytes")
        return "\n".join([f"KV state: {self.n_tokens} tokens, {self.nbytes:,} bytes (DSV4 payload)",
                          *aligned(head, rows)])


def _layer(il: int, ratio: int, saved: LayerPayload, start: int) -> LayerKV:
    def pending(kv, sc):
        return None if kv is None else (kv, sc)

    return LayerKV(il, ratio, saved.raw, np.arange(start, start + len(saved.raw)), saved.comp,
                   pending(saved.comp_state_kv, saved.comp_state_score), saved.index,
                   pending(saved.index_state_kv, saved.index_state_score))
