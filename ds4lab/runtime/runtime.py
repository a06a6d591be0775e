"""How a chunk runs on a model: :class:`Runtime`.

``forward(tokens, state)`` runs positions ``state.n_past …`` through every layer of the model
(:class:`ds4lab.model.transformer.Transformer`) and returns the final HC state and a new :class:`KVState`;
the input state is never modified, so a failed chunk leaves nothing half updated. The runtime checks the
tokens and positions, makes the chunk's RoPE tables, pads, switches tiers, and decides what runs compiled:

- On MLX a layer's attention half works on fixed shapes — the chunk size and the state's capacities — with
  the chunk's start position and its number of real tokens as array inputs: it is compiled once per layer
  and chunk size and reused for every chunk; a prefill's chunks are padded to the state's step (masked) so
  that the last, partial one reuses it too. A chunk's FFN half picks its routed experts on the host and runs
  eagerly. (MLX's CUDA back-end compiles decode-sized steps only.)
- A decode-sized step with the kernels (CuPy, MLX on a GPU) routes its experts on the device, so it runs
  every layer, both halves, as one compiled call: a CUDA graph on CuPy, ``mx.compile`` on MLX (``whole_step``;
  one per half and layer where it is off or the placement has several tiers). Replaying it costs the host one
  call where launching layer by layer cost more than the GPU's work. ``forward_logits`` puts the head in it too.

With an ``observer`` (``observer(name, value)`` at the hook points of :mod:`ds4lab.hooks`, ``head.logits``
included) the chunk runs eagerly and the observer sees every point; it is an argument of the call, so two
sessions on one model can observe different points at the same time.
"""

from __future__ import annotations

import weakref

import numpy as np

from ..kv.layout import KVState, PackedLayers
from ..model.transformer import DEVICE_ROUTING_ROWS
from ..tiers import NO_TIERS, TierRun
from .compiled import (
    attention_half,
    ffn_half,
    layer_state,
    layer_states,
    live_rows,
    present,
    real_rows,
    whole_step,
    written_rows,
)
from .tables import ChunkTables, chunk_tables, rope_keys

# Positions a session's RoPE tables are made for up front (32 pairs of float32 cos and sin: 32 MiB a table at
# this size); a session of a longer context doubles them as its steps get there.
ROPE_PRESIZE_MAX = 1 << 17


class Runtime:
    """Runs chunks of ``model`` on ``backend``. Knobs: ``compile`` (default: whether the backend compiles by
    default), ``whole_step`` (where the backend compiles both halves: every layer in one compiled call).
    ``compiled`` holds the compiled calls by key — ``(layer, ends, rows)`` for an attention half, ``("ffn", layer,
    rows)`` for an FFN half, ``("step", rows, real rows, head, ends)`` for a whole step, each ending with the device
    (``backend.device_key()``); ``ends`` says which compressors' windows the chunk ends (:func:`.tables.ending`:
    a decode step leaves the others' pooling out, so it has up to three calls) — and ``trace_count`` counts the
    attention halves' traces (one per layer, chunk size, ``ends`` and device)."""

    def __init__(self, model, backend, compile: bool | None = None):
        self.model = model
        self.backend = backend
        self.compile = backend.can_compile if compile is None else compile
        self.whole_step = True
        self.compiled: dict[tuple, object] = {}
        # per family, what its compiled calls share (CuPy: their input buffers, each kept while a graph uses it)
        self._families: dict[tuple, weakref.WeakValueDictionary] = {}
        self.trace_count = 0
        self._keys = rope_keys(model)

    def rope_tables_for(self, geometry) -> None:
        """The RoPE tables kept for the positions a session of ``geometry`` reaches (its context, up to
        ROPE_PRESIZE_MAX), made now: made as steps needed them, a table doubled at the first step past a power of
        two, on the host (likely the 30 ms first decode step at 32K on an H100 with the Flash layout's 30 layers,
        benchmarks/README.md)."""
        rope_keys, window_keys = self._keys
        # windows' positions run up to two windows past the tokens'; a chunk padded to the step, a step past them
        margin = 2 * max((R for _, R in window_keys), default=0)
        margin += geometry.step if self.compiles(geometry.step) else 0
        for params in [*rope_keys, *(p for p, _ in window_keys)]:
            params.kept(min(geometry.ctx, ROPE_PRESIZE_MAX) + margin)

    def compiles(self, rows: int) -> bool:
        """Whether a chunk of ``rows`` runs its attention half compiled (MLX) or as a CUDA graph (CuPy)."""
        return self.compile and rows <= self.backend.compiled_rows

    def compiles_ffn(self, rows: int) -> bool:
        """Whether a chunk of ``rows`` also runs its FFN half compiled: where the backend routes its experts on
        the device, as it does for up to DEVICE_ROUTING_ROWS rows (a chunk's are picked on the host)."""
        return self.compiles(rows) and self.backend.compiles_ffn and rows <= DEVICE_ROUTING_ROWS

    def tables(self, tokens: np.ndarray, pos0: int, chunk: int) -> ChunkTables:
        return chunk_tables(self.backend, self._keys, tokens, pos0, chunk, self.compiles(chunk),
                            self.compiles_ffn(chunk))

    # -- a chunk ----------------------------------------------------------------------------------------
    def forward(self, tokens, state: KVState, *, tiers: TierRun | None = None, observer=None,
                prefill: bool = False, pad_to: int | None = None):
        """Run ``tokens`` at positions ``state.n_past …``; returns ``(X [T, n_hc, E], new state)``.

        ``prefill``: the chunk is one of a chunked prefill; where chunks run compiled it is padded to the
        state's step (masked), so that every chunk has the same shapes. ``pad_to`` pads it to that many rows
        whatever runs. The returned X has the real rows only. With ``tiers`` each layer runs on its tier, the
        hidden state switching tiers (and recorded) where the placement changes; X is returned on the output
        head's tier. ``observer``: see the module's docstring. With tiers on the ranks of a process group
        (:mod:`ds4lab.distributed`) a process runs only its ranks' units and keeps only their layers' state (the
        others' states pass through as given); X is None in the processes that do not run the head.
        """
        with self.backend.scope():  # the model's device, whatever the process's default is now
            X, state, _ = self._run(tokens, state, tiers, observer, prefill, pad_to, head=False)
        return X, state

    def forward_logits(self, tokens, state: KVState, *, tiers: TierRun | None = None, observer=None,
                       prefill: bool = False, pad_to: int | None = None, device_ids=None):
        """:meth:`forward`, then the head on the last real token: ``(logits [1, vocab], new state)``. Where
        the whole step is one compiled call, the head is part of it (no launches of its own). With tiers on ranks,
        every process gets the logits. ``device_ids``: the tokens' ids as an int32 device array (a token chosen on
        the device, in the vocabulary by construction), used in place of ``tokens``' values, which then only give
        their count; only where the step is one compiled call (:meth:`whole`)."""
        with self.backend.scope():
            _, state, logits = self._run(tokens, state, tiers, observer, prefill, pad_to, head=True,
                                         device_ids=device_ids)
        return logits, state

    def whole(self, rows: int, tiers: TierRun | None = None, observer=None) -> bool:
        """Whether a chunk of ``rows`` rows (a decode step: 1) runs as one compiled call, every layer and the head."""
        tiers = NO_TIERS if tiers is None else tiers
        if observer is not None or not tiers.one_tier or not self.whole_step:
            return False
        with tiers.scope():  # the tier's device decides: an MLX GPU model's cpu tier has no kernels
            return self.compiles_ffn(rows)

    def _checked(self, tokens, state: KVState) -> np.ndarray:
        """``tokens`` as int64 ids, once they are known to fit the vocabulary, the context and one step."""
        n_vocab = self.model.cfg.n_vocab
        tokens = np.asarray(tokens, dtype=np.int64)
        n = len(tokens)
        if tokens.ndim != 1 or n == 0:
            raise ValueError("forward needs a non-empty 1-D sequence of token ids")
        if tokens.min() < 0 or tokens.max() >= n_vocab:
            bad = int(tokens[(tokens < 0) | (tokens >= n_vocab)][0])
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {n_vocab})")
        geo, pos0 = state.geometry, state.n_past
        if pos0 + n > geo.ctx:
            raise ValueError(f"positions {pos0}…{pos0 + n - 1} exceed the context of {geo.ctx} tokens")
        if n > geo.step:
            raise ValueError(f"a chunk of {n} tokens exceeds the {geo.step} tokens one step can take")
        return tokens

    def _rows(self, n: int, state: KVState, prefill: bool, pad_to: int | None) -> int:
        """The rows a chunk of ``n`` tokens runs as: padded to the step for a compiled prefill chunk."""
        step = state.geometry.step
        if pad_to is None and prefill and self.compiles(step):
            pad_to = step
        return max(n, pad_to or n)

    def _run(self, tokens, state: KVState, tiers, observer, prefill: bool, pad_to, head: bool, device_ids=None):
        model = self.model
        tokens = self._checked(tokens, state)
        n, pos0, C = len(tokens), state.n_past, self._rows(len(tokens), state, prefill, pad_to)
        tiers = NO_TIERS if tiers is None else tiers
        if self.whole(C, tiers, observer):
            with tiers.scope():
                return self._whole_step(tokens, C, state, head, device_ids)
        if device_ids is not None:
            raise ValueError(f"ids on the device need a chunk that runs as one compiled call; {C} rows here do not")
        padded = np.concatenate([tokens, np.zeros(C - n, dtype=np.int64)])
        tiers.start(C)
        with tiers.scope():
            X = model.embed(padded) if tiers.here else None
        tabs = {}  # per device: a tier reads its own copy
        layers = []
        for il in range(model.cfg.n_layer):
            X = tiers.enter(il, X)
            if not tiers.here:  # the layer runs in another process, which holds its state
                layers.append(state.layers[il])
                continue
            with tiers.scope():
                if tiers.device not in tabs:
                    tabs[tiers.device] = self.tables(tokens, pos0, C)
                X, layer = self._attention(il, X, pos0, n, tabs[tiers.device], state.layers[il], observer)
                X = real_rows(model.xp, lambda Y: self._ffn(il, Y, tokens, tabs[tiers.device], observer), X, n)
            layers.append(layer)
        X = tiers.enter(model.cfg.n_layer, X)
        X = None if X is None else X[:n]
        logits = None
        if head:
            if tiers.here:
                with tiers.scope():
                    logits = model.head(X[-1:], observer)
            logits = tiers.share(logits)
        return X, KVState(tuple(layers), pos0 + n, state.geometry), logits

    # -- compiled calls -------------------------------------------------------------------------------
    def _compiled(self, key: tuple, make, carry: tuple[int, int] | None = None, family: tuple | None = None):
        """The compiled call ``key`` on the current device, compiling ``make()`` the first time; ``carry=(i, j)``: its
        outputs from j on are the layers' next state arrays, its inputs from i on the state it was given (see
        ``Backend.compile``). The device ends the key: a call traced with one tier's kernels (or captured on one GPU)
        is not another device's tier's to run. Calls of one ``family`` (the same arguments, a different set of
        windows) share their inputs' buffers where the backend has them (CuPy's graphs: the state held once)."""
        device = self.backend.device_key()
        key = (*key, device)
        if key not in self.compiled:
            shared = None if family is None else self._families.setdefault((*family, device),
                                                                            weakref.WeakValueDictionary())
            self.compiled[key] = self.backend.compile(make(), carry, shared)
        return self.compiled[key]

    def _whole_step(self, tokens, C: int, state: KVState, head: bool, device_ids=None):
        """Every layer of a chunk (and with ``head`` the head on its last real token) as one compiled call (a
        CUDA graph on CuPy), keyed by the chunk's padded and real sizes. Returns ``(X, new state, logits or
        None)``. ``device_ids``: the chunk's ids on the device, instead of the uploaded ones (C = n rows)."""
        cfg, n = self.model.cfg, len(tokens)
        tabs = self.tables(tokens, state.n_past, C)  # pads the ids to C rows
        ids = tabs.chunk_ids if device_ids is None else device_ids
        inputs = [*tabs.scalars, ids, *sum(tabs.rope.values(), ()), *sum(tabs.windows.values(), ())]
        step = self._compiled(("step", C, n, head, tabs.ends),
                              lambda: whole_step(self.model, n, list(tabs.rope), list(tabs.windows), head, tabs.ends),
                              (len(inputs), 1), ("step", C, n, head))
        if isinstance(state.layers, PackedLayers):  # the previous step's outputs
            arrays = state.layers.arrays
            arrays = arrays if isinstance(arrays, (tuple, list)) else [arrays]  # a replay's: one span, passed whole
        else:
            arrays = [a for layer in state.layers for a in present(layer)]
        # the rows of the new state later steps read, and those this step writes (a CUDA graph copies only those out
        # of its buffer, and of them only the ones an older copy it writes over does not hold)
        out = step(*inputs, *arrays, live=live_rows(cfg, state.geometry, state.n_past + n),
                   written=written_rows(cfg, state.geometry, state.n_past, state.n_past + n))
        layers = PackedLayers(out[1:-1] if head else out[1:], cfg.n_layer, lambda a: layer_states(cfg, a))
        return out[0], KVState(layers, state.n_past + n, state.geometry), out[-1] if head else None

    def _attention(self, il: int, X, pos0: int, n_valid: int, tabs: ChunkTables, st, observer):
        """Layer ``il``'s attention half: compiled per layer, chunk size and the windows the chunk ends (whether it
        ends one of the layer's) where it compiles and nothing observes."""
        model = self.model
        params, R = model.ropes[il], model.cfg.ratio(il)
        rope = tabs.rope[params]
        if observer is not None or not self.compiles(X.shape[0]):
            return model.attention_block(il, X, pos0, n_valid, rope, tabs.windows_of(params, R), st, observer)
        inputs = [X, *tabs.scalars, *rope, *(tabs.windows[params, R] if R else ())]
        ends = R in tabs.ends
        half = self._compiled((il, ends, X.shape[0]), lambda: attention_half(model, il, self._traced, ends),
                              (len(inputs), 1), (il, X.shape[0]))
        out = half(*inputs, *present(st))
        return out[0], layer_state(model.cfg, il, out[1:])

    def _traced(self) -> None:
        self.trace_count += 1

    def _ffn(self, il: int, X, tokens: np.ndarray, tabs: ChunkTables, observer):
        """The FFN half; a decode-sized one compiled where the backend compiles it (a CUDA graph on CuPy)."""
        if tabs.ids is None or observer is not None:
            return self.model.ffn_block(il, X, tokens, observer)
        return self._compiled(("ffn", il, X.shape[0]), lambda: ffn_half(self.model, il))(X, tabs.ids)[0]
