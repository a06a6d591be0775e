"""The KV state of a session placed over ranks (:mod:`ds4lab.distributed`), whole on one process: every
rank's layers gathered into one ``DSV4`` payload on rank 0 (which the disk store can save), and a whole
checkpoint on rank 0 scattered back, each rank receiving its own layers.

A layer travels as its payload rows (``layer_to_payload``: the live raw rows, the counted compressed and
indexer rows, the compressor states), flattened into one float32 array; every rank knows the shapes from the
config and the token count, so nothing but the rows crosses the link. Every rank calls :func:`gather` and
:func:`scatter` (they are collective, as the steps are); the rows pass along the ring through
:meth:`~ds4lab.distributed.Ranks.move`.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .kv.checkpoint import Checkpoint, layer_from_payload, layer_to_payload, model_fingerprint
from .kv.layout import KVState, LayerState, layer_state_shapes, new_state, raw_live_rows
from .kv.payload import LayerPayload, Payload, decode_payload, encode_payload

ROOT = 0  # the rank that holds a whole checkpoint


def _move_layer(ranks, cfg, il: int, T: int, geo, saved: LayerPayload | None, src: int, dst: int, what: str):
    """Layer ``il``'s payload rows after ``T`` tokens (``saved``, held by rank ``src``; None elsewhere) on rank
    ``dst``, None elsewhere: flattened in field order, moved, and unflattened there."""
    shapes = layer_state_shapes(cfg, il, T, raw_live_rows(T, geo.window, geo.raw_cap))
    flat = None
    if ranks.rank == src:
        flat = mx.array(np.concatenate([getattr(saved, name).ravel() for name, s in shapes.items() if s]))
    flat = _move(ranks, flat, src, dst, shapes, f"{what} layer {il}'s KV rows")
    return _unpack(flat, shapes) if ranks.rank == dst else None


def gather(placement, model, cp: Checkpoint) -> Checkpoint | None:
    """``cp`` (this rank's part of a checkpoint of a session placed over ranks) with every rank's layers, as a
    payload checkpoint on rank 0; None on the other ranks."""
    ranks, cfg, backend = placement.ranks, model.config, model.backend
    state, T = cp.state, len(cp.tokens)
    geo = state.geometry
    layers = []
    for il in range(cfg.n_layer):
        owner = placement.rank_of(il)
        saved = layer_to_payload(cfg, backend, il, state.layers[il], T, geo) if ranks.rank == owner else None
        saved = _move_layer(ranks, cfg, il, T, geo, saved, owner, ROOT, "gathering")
        if ranks.rank == ROOT:
            layers.append(saved)
    if ranks.rank != ROOT:
        return None
    logits = np.zeros(cfg.n_vocab, np.float32) if cp.logits is None else cp.logits
    payload = Payload(ctx=geo.ctx, prefill_cap=geo.chunk, raw_cap=geo.raw_cap, raw_window=geo.window,
                      comp_cap=geo.comp_cap, tokens=np.asarray(cp.tokens, dtype=np.uint32),
                      logits=np.asarray(logits, dtype=np.float32), layers=layers)
    return Checkpoint(cp.tokens, cp.logits, data=encode_payload(payload, cfg), config=cfg,
                      fingerprint=cp.fingerprint, edits=cp.edits)


def scatter(placement, model, geometry, cp: Checkpoint | None):
    """Rank 0's whole checkpoint ``cp`` (what the other ranks pass is not read) as this rank's part:
    ``(tokens, logits or None, state with this rank's layers, edits)``. Rank 0 checks it against the session
    first (the loader's rules, as ``Session.restore``); when it refuses, every rank raises its reason."""
    ranks, cfg, backend = placement.ranks, model.config, model.backend
    payload, refusal, verdict = None, None, None
    if ranks.rank == ROOT:
        try:
            payload = _checked(cp, model, geometry)
            verdict = b""
        except ValueError as e:
            refusal, verdict = e, f"{type(e).__name__}: {e}".encode()
    verdict = ranks.share_bytes(verdict, ROOT, "scattering a checkpoint: rank 0's check")
    if refusal is not None:
        raise refusal
    if verdict:
        raise ValueError(f"rank {ranks.rank}: rank 0 refused the checkpoint to scatter: {verdict.decode()}")

    head = mx.array([payload.n_tokens, cp.logits is not None] if ranks.rank == ROOT else [0, 0], dtype=mx.int64)
    T, has_logits = (int(v) for v in ranks.share(head, ROOT, (2,), mx.int64, "scattering a checkpoint: its size"))
    tokens, logits = [], None
    if T:
        ids = mx.array(payload.tokens.astype(np.int64)) if ranks.rank == ROOT else None
        tokens = np.array(ranks.share(ids, ROOT, (T,), mx.int64, "scattering a checkpoint: its tokens")).tolist()
    if has_logits:
        row = mx.array(payload.logits) if ranks.rank == ROOT else None
        logits = np.array(ranks.share(row, ROOT, (cfg.n_vocab,), mx.float32, "scattering a checkpoint: its logits"))
    edits = ranks.share_bytes("\0".join(cp.edits).encode() if ranks.rank == ROOT else None, ROOT,
                              "scattering a checkpoint: its edits")

    empty = new_state(cfg, backend, geometry)  # lazy arrays: only this rank's layers are ever made
    layers = []
    for il in range(cfg.n_layer):
        owner = placement.rank_of(il)
        saved = payload.layers[il] if ranks.rank == ROOT else None
        saved = _move_layer(ranks, cfg, il, T, geometry, saved, ROOT, owner, "scattering")
        layers.append(LayerState(raw=None) if saved is None else
                      layer_from_payload(backend, empty.layers[il], saved, T, geometry))
    return tokens, logits, KVState(tuple(layers), T, geometry), tuple(e for e in edits.decode().split("\0") if e)


def _checked(cp: Checkpoint | None, model, geometry) -> Payload:
    """Rank 0's checkpoint as the payload to scatter, refused as ``Session.restore`` refuses (ValueError)."""
    if cp is None:
        raise ValueError("rank 0 passed no checkpoint to scatter")
    if cp.part is not None:
        raise ValueError(f"the checkpoint holds one part of a split state ({cp.part}); scatter a whole one "
                         "(Session.gather's, or a payload)")
    cp.check_model(model.config, model_fingerprint(model))
    return decode_payload(cp.to_bytes(), model.config, geometry.ctx, geometry.chunk)


def _move(ranks, flat, src: int, dst: int, shapes: dict, what: str):
    """One layer's flattened rows from rank ``src`` to rank ``dst`` (a layer may hold no values yet)."""
    size = sum(int(np.prod(s)) for s in shapes.values() if s)
    if size == 0:
        return mx.zeros((0,), dtype=mx.float32) if ranks.rank == dst else None
    return ranks.move(flat, src, dst, (size,), mx.float32, what)[0]


def _unpack(flat, shapes: dict) -> LayerPayload:
    """A :class:`LayerPayload` from its arrays flattened in field order."""
    flat = np.array(flat, dtype=np.float32)
    out, at = {}, 0
    for name, shape in shapes.items():
        if shape is not None:
            n = int(np.prod(shape))
            out[name] = flat[at:at + n].reshape(shape)
            at += n
    return LayerPayload(**out)
