"""Checkpoints: a session's state at one token boundary, in memory or as ds4's ``DSV4`` payload.

A live :class:`Checkpoint` holds the (immutable) backend state itself, so taking one copies nothing
and restoring it is exact. ``to_bytes`` writes the ``DSV4`` payload (float32 rows: exact for the MLX
backend, rounded for the float64 numpy backend); ``from_bytes`` validates one against its own header,
and restoring it validates it again against the session (ds4's loader rules: the same raw window, a context
at least as large, ...) and rebuilds the fixed-capacity state, raw rows scattered back into the ring at
``pos mod raw_cap``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from ..config import ModelConfig
from .layout import LAYER_FIELDS, Geometry, KVState, LayerState, new_state, raw_live_rows
from .payload import LayerPayload, Payload, PayloadError, decode_payload, encode_payload, parse_layout, payload_header


def model_fingerprint(model) -> str | None:
    """``model.file.fingerprint`` (a 32-hex digest of the GGUF's metadata, tensor directory and data samples), or
    None for a model without a file."""
    return getattr(getattr(model, "file", None), "fingerprint", None)


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """Tokens, next-token logits and KV state at one boundary: a live ``state`` or payload ``data``. A live one
    knows the ``config`` and ``backend`` of the model whose state it holds, so it serializes on its own.

    ``fingerprint`` is the model file's fingerprint (``model.file.fingerprint``) where known: checkpoints taken
    by a session carry it, and so do those the KV store loads from files ds4lab wrote. Restoring refuses a
    checkpoint of another model (another config, or another fingerprint: the same config with other weights).
    A bare ``DSV4`` payload has no field for it (ds4's format), so ``from_bytes`` knows it only when told; a
    checkpoint without one is checked on its layout alone.

    ``edits`` describes what changed the state from the one its tokens give: row edits
    (:mod:`ds4lab.kv.edit`) and interventions whose steps made it (:mod:`ds4lab.interventions`); empty for a
    state the model computed from its tokens alone. A ``DSV4`` payload cannot carry it.

    ``part`` marks a state split over processes (a session placed over ranks, :mod:`ds4lab.distributed`): which
    rank's layers this one holds (the session's ``placement.part``); None for a whole state. A part restores only
    into the session part it came from, and serializes only once gathered (``Session.gather``)."""

    tokens: tuple[int, ...]
    logits: np.ndarray | None
    state: KVState | None = None
    data: bytes | None = None
    config: ModelConfig | None = field(default=None, repr=False)
    backend: object = field(default=None, repr=False)
    fingerprint: str | None = field(default=None, repr=False)
    edits: tuple[str, ...] = field(default=(), repr=False)
    part: str | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        kind = "live" if self.state is not None else "payload"
        shown = self.edits if len(self.edits) <= 3 else (*self.edits[:2], f"{len(self.edits) - 2} more (.edits)")
        edited = f", edited: {'; '.join(shown)}" if self.edits else ""
        return f"Checkpoint({len(self.tokens)} tokens, {kind}{edited})"

    @property
    def ctx(self) -> int:
        """The context of the session it was taken in (a payload's ``ctx``)."""
        return self.state.geometry.ctx if self.state is not None else payload_header(self.data)["ctx"]

    def to_bytes(self) -> bytes:
        """ds4's ``DSV4`` payload of this checkpoint (a payload checkpoint's own bytes)."""
        if self.data is not None:
            return self.data
        if self.part is not None:
            raise ValueError(f"this checkpoint holds one part of a state split over processes ({self.part}): "
                             "Session.gather(cp), called on every rank, makes the whole one on rank 0")
        if self.config is None or self.backend is None:
            raise ValueError("this checkpoint holds a live state but not the model it came from; "
                             "take checkpoints with Session.checkpoint()")
        return encode_payload(state_to_payload(self.config, self.backend, self.state, self.tokens, self.logits),
                              self.config)

    def check_model(self, config: ModelConfig, fingerprint: str | None = None) -> None:
        """Refuse a checkpoint of another model (:class:`PayloadError` naming the field and both values): its layer
        count, then any other config field, then the model fingerprint when both are known."""
        msg = "KV checkpoint was written for a different DS4 layout"
        n_layer = (self.config.n_layer if self.config is not None
                   else len(self.state.layers) if self.state is not None else None)
        if n_layer is not None and n_layer != config.n_layer:
            raise PayloadError(f"{msg}: n_layer is {n_layer}, expected {config.n_layer} (this model's)", "n_layer",
                               n_layer, config.n_layer)
        if self.config is not None and self.config != config:
            name = next((f.name for f in fields(config) if getattr(self.config, f.name) != getattr(config, f.name)),
                        "config")
            got, want = getattr(self.config, name, self.config), getattr(config, name, config)
            raise PayloadError(f"KV checkpoint was written for another model configuration: {name} is {got!r}, "
                               f"expected {want!r} (this model's)", name, got, want)
        if self.fingerprint and fingerprint and self.fingerprint != fingerprint:
            raise PayloadError(f"KV checkpoint was written by another model: its model fingerprint is "
                               f"{self.fingerprint}, this model's is {fingerprint}", "model fingerprint",
                               self.fingerprint, fingerprint)

    def check_fits(self, config: ModelConfig, geometry: Geometry, fingerprint: str | None = None) -> None:
        """Refuse, as :meth:`state_for` would, a checkpoint that cannot be restored into a session of ``geometry``
        on ``config`` whose model file has ``fingerprint`` (:class:`PayloadError` naming the field): another model
        (:meth:`check_model`), then ds4's loader rules (the same raw window, a context at least as large, ...),
        checked on the payload's header and row counts without building a state."""
        self.check_model(config, fingerprint)
        if self.state is not None and self.state.geometry == geometry:
            return
        parse_layout(self.to_bytes(), config, ctx=geometry.ctx, prefill_cap=geometry.chunk)

    def state_for(self, config: ModelConfig, backend, geometry: Geometry, fingerprint: str | None = None) -> KVState:
        """The state to restore into a session of ``geometry`` on (``config``, ``backend``) whose model file has
        ``fingerprint``: the live state itself where it fits, else the payload validated against the session and
        rebuilt. A checkpoint of another model is refused first (:meth:`check_model`)."""
        self.check_model(config, fingerprint)
        same_arrays = self.backend is None or self.backend is backend  # another backend's arrays go through bytes
        if self.state is not None and self.state.geometry == geometry and same_arrays:
            return self.state
        data = self.to_bytes()
        return payload_to_state(config, backend, decode_payload(data, config, geometry.ctx, geometry.chunk), geometry)

    @classmethod
    def from_bytes(cls, data: bytes, config: ModelConfig | None = None,
                   fingerprint: str | None = None) -> "Checkpoint":
        """Parse a ``DSV4`` payload, validated against its own header's ctx and chunk and, given, the model's
        ``config`` (without one, the layer layout is inferred from the header and row counts, as ``inspect``
        does); restoring it into a session validates it again against that session's model. ``fingerprint``:
        the model file's fingerprint the bytes were written by, where known (the payload cannot carry it)."""
        payload = decode_payload(data, config)
        return cls(tuple(int(t) for t in payload.tokens), payload.logits, data=bytes(data), config=config,
                   fingerprint=fingerprint)


def state_to_payload(cfg: ModelConfig, backend, state: KVState, tokens, logits) -> Payload:
    """The ``DSV4`` view of a state: the last raw_live raw rows in position order, counted rows."""
    geo = state.geometry
    layers = [layer_to_payload(cfg, backend, il, layer, state.n_past, geo) for il, layer in enumerate(state.layers)]
    return Payload(ctx=geo.ctx, prefill_cap=geo.chunk, raw_cap=geo.raw_cap, raw_window=geo.window,
                   comp_cap=geo.comp_cap, tokens=np.asarray(tokens, dtype=np.uint32),
                   logits=np.asarray(logits, dtype=np.float32), layers=layers)


def layer_to_payload(cfg: ModelConfig, backend, il: int, layer: LayerState, T: int, geo: Geometry) -> LayerPayload:
    """Layer ``il``'s part of :func:`state_to_payload` after ``T`` tokens."""
    live = raw_live_rows(T, geo.window, geo.raw_cap)
    slots = np.arange(T - live, T) % geo.raw_cap
    f32 = lambda x: np.asarray(backend.to_numpy(x), dtype=np.float32)  # noqa: E731
    R = cfg.ratio(il)
    saved = LayerPayload(raw=f32(layer.raw)[slots])
    if R:
        saved.comp = f32(layer.comp)[: T // R]
        saved.comp_state_kv, saved.comp_state_score = f32(layer.comp_state_kv), f32(layer.comp_state_score)
    if cfg.has_indexer(il):
        saved.index = f32(layer.index)[: T // R]
        saved.index_state_kv, saved.index_state_score = f32(layer.index_state_kv), f32(layer.index_state_score)
    return saved


def payload_to_state(cfg: ModelConfig, backend, payload: Payload, geometry: Geometry) -> KVState:
    """Rebuild a state of ``geometry`` from a payload that ``decode_payload`` accepted for it."""
    T = payload.n_tokens
    empty = new_state(cfg, backend, geometry)
    layers = [layer_from_payload(backend, layer, saved, T, geometry)
              for layer, saved in zip(empty.layers, payload.layers)]
    return KVState(tuple(layers), T, geometry)


def layer_from_payload(backend, empty: LayerState, saved: LayerPayload, T: int, geometry: Geometry) -> LayerState:
    """One layer of :func:`payload_to_state`: ``saved``'s rows in the fixed-capacity arrays of ``empty``."""
    arrays = {name: backend.to_numpy(getattr(empty, name)).copy() if getattr(empty, name) is not None else None
              for name in LAYER_FIELDS}
    live = saved.raw.shape[0]
    arrays["raw"][np.arange(T - live, T) % geometry.raw_cap] = saved.raw
    if saved.comp is not None:
        arrays["comp"][: len(saved.comp)] = saved.comp
    if saved.index is not None:
        arrays["index"][: len(saved.index)] = saved.index
    for name in ("comp_state_kv", "comp_state_score", "index_state_kv", "index_state_score"):
        if getattr(saved, name) is not None:
            arrays[name] = getattr(saved, name)
    return LayerState(**{k: None if v is None else backend.asarray(v) for k, v in arrays.items()})
