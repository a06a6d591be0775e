"""What every layer of a chunk reads, made on the host once per chunk and device: :class:`ChunkTables`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..arch import coff, n_blocks


@dataclass(frozen=True)
class ChunkTables:
    """RoPE tables per layer kind (the chunk's positions, and the start positions of the compressed windows
    the chunk can complete), and for compiled calls the start, the count of real tokens and the ids as device
    arrays (uploaded once here: an upload per layer would wait for the GPU each time)."""

    rope: dict  # RopeParams -> (cos, sin) [C, n_rot/2]
    windows: dict  # (RopeParams, ratio) -> (cos, sin) [n_windows, n_rot/2]
    scalars: tuple  # (pos0, n_valid) as the backend passes them into compiled functions
    ids: object  # the real tokens' ids, int32 on the device, where the backend compiles the FFN half
    ends: tuple  # the ratios whose windows the chunk may end (ending): the others' pooling is left out
    chunk_ids: object = None  # the same with the padded rows' (0), which a compiled step embeds on the device

    def windows_of(self, params, R: int):
        """The window tables of a layer of ratio ``R``, or None where the chunk ends none of its windows."""
        return self.windows[params, R] if R in self.ends else None


def ending(ratios, pos0: int, rows: int) -> tuple:
    """Of the compressed layers' ``ratios``, those whose windows a chunk of ``rows`` rows (padded or not) from
    ``pos0`` may end: for a decode step (one row) those it ends, so that it can leave the others' pooling out (one
    step in 4 ends a ratio-4 window, one in 128 a ratio-128 one); for a longer chunk every ratio, so that its
    compiled calls do not multiply by the positions it starts at or the real rows it holds."""
    return tuple(sorted(R for R in set(ratios) if rows > 1 or (pos0 + 1) // R > pos0 // R))


def rope_keys(model) -> tuple[list, list]:
    """The distinct RoPE tables a chunk of ``model`` reads, in table order: per layer kind, and per (kind,
    ratio) of the compressed layers' windows."""
    cfg = model.cfg
    return (list(dict.fromkeys(model.ropes)),
            list(dict.fromkeys((p, cfg.ratio(il)) for il, p in enumerate(model.ropes) if cfg.ratio(il))))


def chunk_tables(backend, keys: tuple[list, list], tokens: np.ndarray, pos0: int, chunk: int,
                 compiled: bool, ffn: bool = False) -> ChunkTables:
    """The tables of ``tokens`` at positions ``pos0 …`` padded to ``chunk`` rows, on the backend's current
    device; with ``compiled`` also the scalars (and with ``ffn``, where the FFN half runs compiled too, the ids)
    that compiled calls take as device arrays."""
    rope_keys, window_keys = keys
    host = []
    if compiled:  # in the order a compiled step takes them, so that its graph copies them in as one span
        host += [np.int32(pos0), np.int32(len(tokens))]
        if ffn:
            host.append(tokens if len(tokens) == chunk else np.pad(tokens, (0, chunk - len(tokens))))
    n_ints = len(host)
    positions = [pos0 + np.arange(chunk) for _ in rope_keys]
    positions += [(pos0 // R + np.arange(n_blocks(R, chunk) - (coff(R) - 1))) * R for _, R in window_keys]
    params = [*rope_keys, *(p for p, _ in window_keys)]
    gather = backend.gathers_rope_rows
    host += positions if gather else [t for p, pos in zip(params, positions) for t in p.rows(pos)]
    dev = backend.upload(host)  # one transfer where the backend packs them (CuPy)
    ints, dev = dev[:n_ints], iter(dev[n_ints:])
    rows = [backend.rope_rows(p, pos, next(dev)) if gather else (next(dev), next(dev))
            for p, pos in zip(params, positions)]
    rope, windows = dict(zip(rope_keys, rows)), dict(zip(window_keys, rows[len(rope_keys):]))
    ends = ending([R for _, R in window_keys], pos0, chunk)
    if not compiled:
        return ChunkTables(rope, windows, (pos0, len(tokens)), None, ends)
    if not ffn:
        return ChunkTables(rope, windows, tuple(ints[:2]), None, ends)
    chunk_ids = ints[2]
    return ChunkTables(rope, windows, tuple(ints[:2]), chunk_ids[:len(tokens)] if len(tokens) < chunk else chunk_ids,
                       ends, chunk_ids)
