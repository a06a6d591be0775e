"""The model's blocks as functions of arrays only, for a backend to compile (``mx.compile``; a CUDA graph on
CuPy, :mod:`ds4lab.cuda.graphs`): one layer's attention half, one layer's FFN half, and the whole step (every
layer, and optionally the head). Their arguments are the HC state, the chunk's start and real-row count, its
ids and RoPE tables as device arrays, and the layers' state arrays, flattened (only the arrays a layer has)."""

from __future__ import annotations

from ..kv.layout import LayerState, raw_live_rows


def present(layer: LayerState) -> list:
    """A layer's state arrays, flattened: those it has (raw; + compressor, R ≠ 0; + indexer, R = 4)."""
    return [a for a in layer.arrays() if a is not None]


def _has(cfg, il: int) -> tuple[bool, ...]:
    """Which of LayerState's arrays layer ``il`` has."""
    R = cfg.ratio(il)
    return (True,) + (R != 0,) * 3 + (R == 4,) * 3


def layer_state(cfg, il: int, arrays) -> LayerState:
    """Layer ``il``'s state from its :func:`present` arrays. From an iterator it takes just the layer's arrays."""
    it = iter(arrays)
    return LayerState.from_arrays([next(it) if h else None for h in _has(cfg, il)])


def live_rows(cfg, geometry, n: int) -> list:
    """For each array of a whole step's state after ``n`` tokens (every layer's :func:`present` arrays, in order): the
    row ranges ``((start, stop), ...)`` of it that any later step reads, or None for all of it: the raw ring's slots of
    the window's positions (one range, or two where they wrap), the compressed and indexer rows below the count (the
    rows a .kv payload holds); the compressors' pending states whole. The kernels read nothing else
    (tests/test_cpu_emulator.py), so a copy of the state may leave the rest out."""
    live = raw_live_rows(n, geometry.window, geometry.raw_cap)
    return _by_array(cfg, _slots(n - live, live, geometry.raw_cap), lambda R: ((0, n // R),) if n // R else ())


def written_rows(cfg, geometry, n0: int, n: int) -> list:
    """For each array of a whole step's state, as :func:`live_rows`: the row ranges that the chunk of positions
    ``[n0, n)`` writes, or None for all of it: the ring's slots of those positions, the compressed and indexer rows
    its windows complete (they are appended, never rewritten), the pending states whole
    (tests/test_cpu_emulator.py checks that a step changes nothing else). A copy of the state made before the chunk
    needs only these rows of it to be the state after (:func:`ds4lab.backends.packing.stale_rows`)."""
    return _by_array(cfg, _slots(n0, n - n0, geometry.raw_cap),
                     lambda R: ((n0 // R, n // R),) if n // R > n0 // R else ())


def _slots(start: int, count: int, cap: int) -> tuple:
    """The ring slots of positions ``[start, start + count)``: one range, or two where they wrap."""
    if count >= cap:
        return ((0, cap),)
    a = start % cap
    return () if not count else ((a, a + count),) if a + count <= cap else ((a, cap), (0, a + count - cap))


def _by_array(cfg, ring: tuple, rows) -> list:
    """Per state array, in :func:`present`'s order: ``ring`` for a raw ring, ``rows(R)`` for a ratio-R layer's
    compressed and indexer rows, None for its pending states."""
    out = []
    for il in range(cfg.n_layer):
        R = cfg.ratio(il)
        r = rows(R) if R else ()
        out += [x for x, h in zip((ring, r, None, None, r, None, None), _has(cfg, il)) if h]
    return out


def layer_states(cfg, arrays) -> tuple[LayerState, ...]:
    """Every layer's state from the run of their :func:`present` arrays (a whole step's outputs)."""
    it = iter(arrays)
    return tuple(layer_state(cfg, il, it) for il in range(cfg.n_layer))


def real_rows(xp, fn, X, n: int):
    """``fn`` (the FFN half) on the first ``n`` rows of X, the padded rows passed through."""
    return fn(X) if X.shape[0] == n else xp.concatenate([fn(X[:n]), X[n:]], axis=0)


def attention_half(model, il: int, traced, ends: bool):
    """Layer ``il``'s attention block: (X, pos0, n_valid, cos, sin[, window cos, window sin], state arrays) ->
    (X, new state arrays). ``traced()`` is called once per trace (not once per call). ``ends``: whether the chunks
    it runs end a window of the layer's ratio (if not, the window tables are taken and left unread)."""
    R = model.cfg.ratio(il)

    def step(X, pos0, n_valid, cos, sin, *rest):
        traced()
        wcos, wsin, arrays = (rest[0], rest[1], rest[2:]) if R else (None, None, rest)
        st = layer_state(model.cfg, il, arrays)
        X, new = model.attention_block(il, X, pos0, n_valid, (cos, sin), (wcos, wsin) if ends else None, st)
        return (X, *present(new))

    return step


def ffn_half(model, il: int):
    """Layer ``il``'s FFN block: (X, device ids) -> (X,)."""
    return lambda X, ids: (model.ffn_block(il, X, ids),)


def whole_step(model, n: int, rope_keys: list, window_keys: list, head: bool, ends: tuple):
    """The whole chunk of ``n`` real rows: (pos0, n_valid, the chunk's ids padded to C rows, RoPE tables, window
    tables, every layer's state arrays) -> (X of the real rows, every layer's new arrays, and with ``head`` the
    logits of the last real row). The embedding rows are looked up and decoded on the device, inside it. ``ends``:
    the ratios whose windows its chunks end (:func:`.tables.ending`); the other ratios' window tables are unread."""
    cfg, xp = model.cfg, model.xp

    def step(pos0, n_valid, chunk_ids, *rest):
        it = iter(rest)
        rope = {k: (next(it), next(it)) for k in rope_keys}
        windows = {k: (next(it), next(it)) for k in window_keys}
        X = model.embed_on_device(chunk_ids)
        ids = chunk_ids[:n]
        new = []
        # one call: each half may start the next one's mixer on the X it returns (a chunk of real rows only, so that
        # the FFN half is given that X, not its real rows')
        chain = X.shape[0] == n
        for il, params in enumerate(model.ropes):
            R = cfg.ratio(il)
            X, layer = model.attention_block(il, X, pos0, n_valid, rope[params],
                                             windows[params, R] if R in ends else None, layer_state(cfg, il, it),
                                             chain=chain)
            X = real_rows(xp, lambda Y: model.ffn_block(il, Y, ids, chain=chain), X, n)
            new += present(layer)
        return (X[:n], *new, model.head(X[n - 1:n])) if head else (X[:n], *new)

    return step
