"""Editing a checkpoint's KV rows, and saving it as a ``.kv`` file that ds4 and ds4lab load.

A row is named by its layer, its kind and an index: ``"raw"`` rows by absolute position (the raw window's
rows, the ones a ``DSV4`` payload keeps: the last ``min(T, raw_window, raw_cap)`` positions), ``"comp"`` and
``"index"`` rows by row number (``0 … ⌊T/R⌋ − 1``). ``edit_rows`` returns a new :class:`Checkpoint` with rows
overwritten (a live one stays live, a payload one is re-encoded), ``patch_rows`` takes them from another
checkpoint of the same model; the source is never modified. An edited checkpoint carries a description of
each edit in ``edits``: a session restored from it says so (``Session.edits``), ``sync`` never reuses it as
the state of its tokens, and ``KVStore.save`` refuses it (a store entry would be found as the clean state of
its text). ``save_kv`` writes it to a path of the caller's choosing, as one ``KVC`` file in ds4-server's
format (docs/FORMATS.md): ds4's format has no field for the edits, so the file carries only ds4lab's mark that its
state was edited (its trailer's flag); ``load_kv`` reads one back, checked, and marked edited where the file says so.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np

from ..config import ds4_model_id, is_int
from .checkpoint import Checkpoint, model_fingerprint
from .kvfile import KVFile, KVFileError, kv_file_parts, write_file_atomic
from .layout import ROW_FIELDS, KVState
from .payload import VERSION, PayloadError, decode_payload, encode_payload, with_version
from .store import checked_checkpoint, routed_quant_bits, token_text


def row_slot(cp: Checkpoint, layer: int, kind: str, index: int) -> int:
    """Where row ``index`` of ``kind`` lives in layer ``layer``'s array of a live state: a raw position's ring
    slot, or the row itself. A ValueError names the value when the checkpoint holds no such row."""
    cfg, T = _config(cp), len(cp)
    layer = cfg.check_layer(layer)
    if kind not in ROW_FIELDS:
        raise ValueError(f"row kind {kind!r} is not one of {', '.join(ROW_FIELDS)}")
    if not is_int(index):  # 1.7 or "1" was read as row 1
        raise ValueError(f"a {kind} row is a whole number, got {index!r}")
    R = cfg.ratio(layer)
    if kind == "raw":
        window, raw_cap = _raw_window(cp)
        live = min(T, window, raw_cap)
        if not T - live <= index < T:
            raise ValueError(f"raw position {index} is not in the raw window of this {T}-token checkpoint "
                             f"(positions {T - live} … {T - 1})")
        return index % raw_cap
    if kind == "comp" and not R or kind == "index" and not cfg.has_indexer(layer):
        raise ValueError(f"layer {layer} (ratio {R}) has no {kind} rows")
    if not 0 <= index < T // R:
        rows = f"rows 0 … {T // R - 1}" if T // R else f"none yet: its first closes at token {R - 1}"
        raise ValueError(f"{kind} row {index} is not a row of layer {layer} after {T} tokens ({rows})")
    return index


def checkpoint_row(cp: Checkpoint, layer: int, kind: str, index: int) -> np.ndarray:
    """Row ``index`` of ``kind`` in layer ``layer`` of ``cp`` (a copy, in the checkpoint's precision)."""
    slot = row_slot(cp, layer, kind, index)
    if cp.state is not None:
        return np.array(cp.backend.to_numpy(getattr(cp.state.layers[layer], kind))[slot])
    saved = getattr(decode_payload(cp.data, cp.config).layers[layer], kind)
    return saved[index - (len(cp) - len(saved))] if kind == "raw" else saved[index]


def edit_rows(cp: Checkpoint, layer: int, kind: str, rows: dict, label: str | None = None) -> Checkpoint:
    """A copy of ``cp`` with rows ``{index: values}`` of ``kind`` in layer ``layer`` overwritten; ``label``
    describes the edit in the copy's ``edits`` (default: which rows)."""
    cfg = _config(cp)
    width = cfg.idx_dim if kind == "index" else cfg.head_dim
    if not isinstance(rows, dict) or not rows:
        raise ValueError(f"rows is a dict {{index: values}} of at least one row, got {rows!r:.60}")
    slots, values = [], []
    for index, value in rows.items():
        slots.append(row_slot(cp, layer, kind, index))
        if np.iscomplexobj(value):  # the cast below kept the real part, with only a warning
            raise ValueError(f"{kind} row {index} of layer {layer}: complex values; a row holds real numbers")
        value = np.asarray(value, dtype=np.float64)
        # finite as the state's float32 holds them: 1e300 passed here and failed at save_kv as an inf
        finite = bool(np.isfinite(value).all() and (np.abs(value) <= np.finfo(np.float32).max).all())
        if value.shape != (width,) or not finite:
            raise ValueError(f"{kind} row {index} of layer {layer}: values of shape {value.shape} (finite as float32: "
                             f"{finite}), expected {width} finite values")
        values.append(value)
    label = label or f"blk.{layer}.{kind}[{', '.join(str(int(i)) for i in rows)}] edited"
    edits = cp.edits + (label,)
    if cp.state is not None:
        b = cp.backend
        array = np.array(b.to_numpy(getattr(cp.state.layers[layer], kind)))
        array[slots] = values
        layers = list(cp.state.layers)
        layers[layer] = dataclasses.replace(layers[layer], **{kind: b.asarray(array)})
        state = KVState(tuple(layers), cp.state.n_past, cp.state.geometry)
        return dataclasses.replace(cp, state=state, edits=edits)
    payload = decode_payload(cp.data, cfg)
    saved = getattr(payload.layers[layer], kind)
    offset = len(cp) - len(saved) if kind == "raw" else 0
    for index, value in zip(rows, values):
        saved[int(index) - offset] = value
    return dataclasses.replace(cp, data=encode_payload(payload, cfg), edits=edits)


def patch_rows(cp: Checkpoint, source: Checkpoint, layer: int, kind: str, indices) -> Checkpoint:
    """A copy of ``cp`` whose rows ``indices`` of ``kind`` in layer ``layer`` are ``source``'s rows of the same
    indices (another prompt's checkpoint of the same model)."""
    source.check_model(_config(cp), cp.fingerprint)
    given = [indices] if is_int(indices) else list(indices) if isinstance(indices, (list, tuple, range,
                                                                                     np.ndarray)) else []
    if not given:
        raise ValueError(f"indices: the rows to patch, a number or a list of them, got {indices!r:.60}")
    rows = {i: checkpoint_row(source, layer, kind, i) for i in given}  # each checked there
    indices = [int(i) for i in given]
    return edit_rows(cp, layer, kind, rows, label=f"blk.{layer}.{kind}{indices} patched from another checkpoint "
                                                  f"({len(source)} tokens)")


def save_kv(cp: Checkpoint, path: str | os.PathLike, model, reason: str = "shutdown",
            checksum: bool = True, payload_version: int = VERSION) -> KVFile:
    """Write ``cp`` (edited or not) to ``path`` as one ``KVC`` file — the header, the text of its tokens, its
    ``DSV4`` payload, ``model``'s fingerprint trailer and, with ``checksum``, the CRC trailer — exactly as a
    :class:`~.store.KVStore` writes one (fsynced, then renamed into place), and open it back. ds4-server loads
    it under its store's name for the text, ``KVFile.sha1 + ".kv"``; ds4lab with :func:`load_kv` (its checksum and
    model fingerprint checked). Payload rows are float32 (ds4's format), ``DSV4``
    version ``payload_version``: 2 for ds4 since 2026-05-26, 1 for a ds4 built before. An edited checkpoint's file
    says it was edited (its trailer's flag; version 2 only), so that what loads it is marked edited too."""
    cp.check_model(model.config, model_fingerprint(model))
    if cp.logits is None:
        raise ValueError("a .kv file holds next-token logits; this checkpoint has none")
    path = Path(path)
    _, parts = kv_file_parts(token_text(model.tokenizer, cp.tokens), with_version(cp.to_bytes(), payload_version),
                             tokens=len(cp), ctx=cp.ctx, quant_bits=routed_quant_bits(model), reason=reason,
                             fingerprint=cp.fingerprint, with_checksum=checksum, payload_version=payload_version,
                             model_id=ds4_model_id(model.config), edited=bool(cp.edits))
    write_file_atomic(path, parts)
    return KVFile.open(path, model.config)


def load_kv(path: str | os.PathLike, model) -> Checkpoint:
    """One ``.kv`` file (``save_kv``'s, a :class:`~.store.KVStore`'s or ds4-server's) as a checkpoint of ``model``,
    with the checks a store makes before it loads one: the file's structure and checksum, its model fingerprint
    against ``model``'s where the file carries one (ds4-server's files carry none), and its text against the text
    of its token ids in ``model``'s tokenizer. A refusal is a :class:`~.kvfile.KVFileError` naming the file and the
    field. ``Session.restore`` makes the result the live state."""
    kf = KVFile.open(path, model.config)
    try:
        return checked_checkpoint(kf, model.config, model_fingerprint(model), model.tokenizer)
    except PayloadError as e:
        raise KVFileError.of_payload(kf.path, e) from e


def _config(cp: Checkpoint):
    if cp.config is None:
        raise ValueError("this checkpoint does not know its model: read it with Checkpoint.from_bytes(data, config)")
    return cp.config


def _raw_window(cp: Checkpoint) -> tuple[int, int]:
    """(raw window, raw ring capacity) of the session the checkpoint was taken in."""
    geo = cp.state.geometry if cp.state is not None else decode_payload(cp.data, cp.config)
    return geo.raw_window if cp.state is None else geo.window, geo.raw_cap
