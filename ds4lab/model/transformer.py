"""The DS4 forward pass over a chunk of tokens (docs/MODEL.md, "Overview"), written once over a backend.

``forward(tokens, state)`` runs positions ``state.n_past …`` through every layer and returns the final
HC state and a new :class:`KVState`; the input state is never modified, so a failed chunk leaves
nothing half updated. Every rule is written per query position, as that section states them, so one chunk
holding the whole prompt (one-shot prefill) and chunk after chunk give the same result.

The attention half of a layer works on fixed shapes — the chunk size and the state's capacities — with
the chunk's start position and its number of real tokens as array inputs: on MLX it is compiled once
per layer and chunk size and reused for every chunk, the last partial one included (padded and
masked). A chunk's FFN half picks its routed experts on the host and runs eagerly; a decode step's picks
them on the device (kernel backends). So on CuPy a decode-sized step runs every layer, both halves, as
one CUDA graph (``whole_step``; one graph per half and layer where it is off or the placement has several
tiers): replaying it costs the host one launch where launching layer by layer cost more than the GPU's
work. ``forward_logits`` puts the head in that graph too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import ModelConfig
from ..kv.layout import KVState, LayerState, PackedLayers
from ..ops import Ops
from ..tiers import NO_TIERS, TierRun
from .attention import grouped_output, grouped_output_gathered
from .compressor import coff, n_blocks
from .functional import rmsnorm
from .hc import hc_head
from .moe import route_weights, routed_experts, routed_experts_gathered, router_probs, select_topk
from .rope import RopeParams
from .weights import Weights

NUMERICS = ("ds4", "exact")
GATHER_MAX_PAIRS = 64  # (token, group) pairs up to which attn_output_a runs gathered, when the backend can
# Up to this many tokens, kernel backends choose experts on the device with no host sync (a decode step can
# be a CUDA graph). A longer chunk's top-k routing runs there too, and only the chosen ids come back for
# qgemm's tiles: sorting the chunk's probabilities on the host left the GPU idle (benchmarks/README.md).
DEVICE_ROUTING_ROWS = 16


@dataclass(frozen=True)
class ChunkTables:
    """What every layer of a chunk reads, made on the host once per chunk and device: RoPE tables per
    layer kind (the chunk's positions, and the start positions of the compressed windows the chunk can
    complete), and for compiled steps the start, the count of real tokens and the ids as device arrays
    (uploaded once here: an upload per layer would wait for the GPU each time)."""

    rope: dict  # RopeParams -> (cos, sin) [C, n_rot/2]
    windows: dict  # (RopeParams, ratio) -> (cos, sin) [n_windows, n_rot/2]
    scalars: tuple  # (pos0, n_valid) as the backend passes them into compiled functions
    ids: object  # the real tokens' ids, int32 on the device, where the backend compiles the FFN half
    chunk_ids: object = None  # the same with the padded rows' (0), which a compiled step embeds on the device


class Transformer:
    def __init__(self, config: ModelConfig, file, backend, numerics: str = "ds4", compile: bool | None = None,
                 weights=None):
        if numerics not in NUMERICS:
            raise ValueError(f"unknown numerics {numerics!r}; choose one of {', '.join(NUMERICS)}")
        self.cfg = config
        self.backend = backend
        self.ops = Ops(backend)
        self.numerics = numerics
        self.w = weights if weights is not None else Weights(file, backend, config.o_groups, config.o_lora)
        self.ropes = [RopeParams.for_layer(config, il) for il in range(config.n_layer)]
        self._rope_keys = list(dict.fromkeys(self.ropes))  # the distinct tables a chunk reads, in table order
        self._window_keys = list(dict.fromkeys((p, config.ratio(il)) for il, p in enumerate(self.ropes)
                                               if config.ratio(il)))
        # Called as observer(name, value) at the named points below when set (eager runs only).
        self.observer = None
        self.compile = backend.can_compile if compile is None else compile
        self._compiled: dict[tuple[int, int], object] = {}
        self.trace_count = 0  # attention-step traces: one per (layer, chunk size) when compiled
        self.gather_max_pairs = GATHER_MAX_PAIRS
        self.whole_step = True  # where the backend compiles both halves: every layer in one compiled call

    def _emit(self, name: str, value) -> None:
        if self.observer is not None:
            self.observer(name, value)

    # -- numerics (docs/MODEL.md, "Numerics") ----------------------------------------------------------
    def store_kv(self, x):
        """FP8 on the non-RoPE dims, then F16 rounding, as every cached attention row is stored."""
        return x if self.numerics == "exact" else self.ops.store_kv(x, self.cfg.n_rot)

    def indexer_quant(self, x):
        return x if self.numerics == "exact" else self.ops.hadamard_fp4(x)

    def store_index(self, x):
        """Hadamard + FP4, then F16 rounding, as every indexer row is stored."""
        return x if self.numerics == "exact" else self.ops.hadamard_fp4(x, f16=True)

    # -- forward --------------------------------------------------------------------------------------
    def tables(self, tokens: np.ndarray, pos0: int, chunk: int) -> ChunkTables:
        b, rope_keys, window_keys = self.backend, self._rope_keys, self._window_keys
        compiled = self.compiles(chunk)
        host = []
        if compiled:  # in the order a compiled step takes them, so that its graph copies them in as one span
            host += [np.int32(pos0), np.int32(len(tokens))]
            if b.compiles_ffn:
                host.append(tokens if len(tokens) == chunk else np.pad(tokens, (0, chunk - len(tokens))))
        n_ints = len(host)
        host += [t for p in rope_keys for t in p.rows(pos0 + np.arange(chunk))]
        for p, R in window_keys:
            n = n_blocks(R, chunk) - (coff(R) - 1)
            host += p.rows((pos0 // R + np.arange(n)) * R)
        dev = b.upload(host)  # one transfer where the backend packs them (CuPy)
        ints, dev = dev[:n_ints], iter(dev[n_ints:])
        rope = {p: (next(dev), next(dev)) for p in rope_keys}
        windows = {k: (next(dev), next(dev)) for k in window_keys}
        if not compiled:
            return ChunkTables(rope, windows, (pos0, len(tokens)), None)
        if not b.compiles_ffn:
            return ChunkTables(rope, windows, tuple(ints[:2]), None)
        chunk_ids = ints[2]
        return ChunkTables(rope, windows, tuple(ints[:2]), chunk_ids[:len(tokens)] if len(tokens) < chunk
                           else chunk_ids, chunk_ids)

    def forward(self, tokens, state: KVState, pad_to: int | None = None, tiers: TierRun | None = None):
        """Run ``tokens`` at positions ``state.n_past …``; returns ``(X [T, n_hc, E], new state)``.

        With ``pad_to`` the chunk is padded to that many rows (masked), so every chunk of a prefill
        has the same shapes; the returned X has the real rows only. With ``tiers`` each layer runs on
        its tier, the hidden state switching tiers (and recorded) where the placement changes; X is
        returned on the output head's tier.
        """
        X, state, _ = self._forward(tokens, state, pad_to, tiers, head=False)
        return X, state

    def forward_logits(self, tokens, state: KVState, pad_to: int | None = None, tiers: TierRun | None = None):
        """:meth:`forward`, then the head on the last real token: ``(logits [1, vocab], new state)``. Where
        the whole step is one compiled call, the head is part of it (no launches of its own)."""
        _, state, logits = self._forward(tokens, state, pad_to, tiers, head=True)
        return logits, state

    def _forward(self, tokens, state: KVState, pad_to, tiers, head: bool):
        cfg, b = self.cfg, self.backend
        xp = b.xp
        tokens = np.asarray(tokens, dtype=np.int64)
        n = len(tokens)
        if tokens.ndim != 1 or n == 0:
            raise ValueError("forward needs a non-empty 1-D sequence of token ids")
        if tokens.min() < 0 or tokens.max() >= cfg.n_vocab:
            bad = int(tokens[(tokens < 0) | (tokens >= cfg.n_vocab)][0])
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {cfg.n_vocab})")
        geo, pos0 = state.geometry, state.n_past
        C = max(n, pad_to or n)
        if pos0 + n > geo.ctx:
            raise ValueError(f"positions {pos0}…{pos0 + n - 1} exceed the context of {geo.ctx} tokens")
        if n > geo.step:
            raise ValueError(f"a chunk of {n} tokens exceeds the {geo.step} tokens one step can take")
        tiers = NO_TIERS if tiers is None else tiers
        if tiers.one_tier and self.whole_step and self.compiles(C) and b.compiles_ffn and self.observer is None:
            with tiers.scope():
                return self._compiled_step(tokens, C, state, head)
        padded = np.concatenate([tokens, np.zeros(C - n, dtype=np.int64)])
        tiers.start()
        with tiers.scope():
            X = xp.broadcast_to(self.w.embed(padded)[:, None, :], (C, cfg.n_hc, cfg.n_embd))
            tabs = {tiers.device: self.tables(tokens, pos0, C)}  # per device: a tier reads its own copy
        layers = []
        for il in range(cfg.n_layer):
            X = tiers.enter(il, X)
            with tiers.scope():
                if tiers.device not in tabs:
                    tabs[tiers.device] = self.tables(tokens, pos0, C)
                X, layer = self._attention(il, X, pos0, n, tabs[tiers.device], state.layers[il])
                X = self._real_rows(lambda Y: self._ffn(il, Y, tokens, tabs[tiers.device]), X, n)
            layers.append(layer)
        X = tiers.enter(cfg.n_layer, X)[:n]
        logits = None
        if head:
            with tiers.scope():
                logits = self.head(X[-1:])
        return X, KVState(tuple(layers), pos0 + n, geo), logits

    def _real_rows(self, fn, X, n: int):
        """``fn`` (the FFN half) on the first ``n`` rows of X, the padded rows passed through."""
        return fn(X) if X.shape[0] == n else self.backend.xp.concatenate([fn(X[:n]), X[n:]], axis=0)

    def _compiled_step(self, tokens, C: int, state: KVState, head: bool):
        """Every layer of a chunk (and with ``head`` the head on its last real token) as one compiled call
        (a CUDA graph on CuPy), keyed by the chunk's padded and real sizes; the embedding rows are looked
        up and decoded on the device, inside it (:meth:`tables` pads the ids to ``C`` rows). Returns ``(X, new
        state, logits or None)``."""
        n = len(tokens)
        tabs = self.tables(tokens, state.n_past, C)
        key = ("step", C, n, head)
        if key not in self._compiled:
            self._compiled[key] = self.backend.compile(
                self._step_arrays(n, list(tabs.rope), list(tabs.windows), head))
        if isinstance(state.layers, PackedLayers):  # the previous step's outputs
            arrays = state.layers.arrays
            arrays = arrays if isinstance(arrays, (tuple, list)) else [arrays]  # a replay's: one span, passed whole
        else:
            arrays = [a for layer in state.layers for a in layer.arrays() if a is not None]
        out = self._compiled[key](*tabs.scalars, tabs.chunk_ids, *sum(tabs.rope.values(), ()),
                                  *sum(tabs.windows.values(), ()), *arrays)
        layers = PackedLayers(out[1:-1] if head else out[1:], self.cfg.n_layer, self._unflatten_all)
        return out[0], KVState(layers, state.n_past + n, state.geometry), out[-1] if head else None

    def _unflatten_all(self, arrays) -> tuple[LayerState, ...]:
        it = iter(arrays)
        return tuple(self._unflatten(il, it) for il in range(self.cfg.n_layer))

    def _step_arrays(self, n: int, rope_keys: list, window_keys: list, head: bool):
        """The whole chunk as a function of arrays only: (pos0, n_valid, the chunk's ids, RoPE tables,
        window tables, every layer's state arrays) -> (X of the real rows, every layer's new arrays, and
        with ``head`` the logits of the last real row)."""
        cfg, xp = self.cfg, self.backend.xp

        def step(pos0, n_valid, chunk_ids, *rest):
            it = iter(rest)
            rope = {k: (next(it), next(it)) for k in rope_keys}
            windows = {k: (next(it), next(it)) for k in window_keys}
            emb = self.w.embed_on_device(chunk_ids)
            ids = chunk_ids[:n]
            X = xp.broadcast_to(emb[:, None, :], (emb.shape[0], cfg.n_hc, cfg.n_embd))
            new = []
            for il, params in enumerate(self.ropes):
                R = cfg.ratio(il)
                X, layer = self.attention_block(il, X, pos0, n_valid, rope[params],
                                                windows[params, R] if R else (None, None), self._unflatten(il, it))
                X = self._real_rows(lambda Y: self.ffn_block(il, Y, ids), X, n)
                new += [a for a in layer.arrays() if a is not None]
            return (X[:n], *new, self.head(X[n - 1:n])) if head else (X[:n], *new)

        return step

    def head(self, X):
        """Logits ``[T, vocab]`` from the final HC state (docs/MODEL.md, "The head")."""
        cfg, xp, w = self.cfg, self.backend.xp, self.w
        emb = hc_head(xp, X, w.linear("output_hc_fn.weight"), w.vector("output_hc_scale.weight"),
                      w.vector("output_hc_base.weight"), eps=cfg.hc_eps, norm_eps=cfg.rms_eps)
        return w.linear("output.weight")(rmsnorm(xp, emb, cfg.rms_eps, w.vector("output_norm.weight")))

    def _hc_pre(self, il: int, sub: str, X):
        """(x_in, post, comb) of the hyper-connection mixer before a sublayer (see :func:`.hc.hc_pre`)."""
        p, w, cfg = f"blk.{il}.hc_{sub}_", self.w, self.cfg
        return self.ops.hc_pre(X, w.linear(p + "fn.weight"), w.vector(p + "scale.weight"),
                                   w.vector(p + "base.weight"), iters=cfg.sinkhorn_iters, eps=cfg.hc_eps,
                                   norm_eps=cfg.rms_eps)

    # -- attention half -------------------------------------------------------------------------------
    def _attention(self, il: int, X, pos0: int, n_valid: int, tabs: ChunkTables, st: LayerState):
        params, R = self.ropes[il], self.cfg.ratio(il)
        rope = tabs.rope[params]
        win = tabs.windows[params, R] if R else (None, None)
        if not (self.compiles(X.shape[0]) and self.observer is None):
            return self.attention_block(il, X, pos0, n_valid, rope, win, st)
        key = (il, X.shape[0])
        if key not in self._compiled:
            self._compiled[key] = self.backend.compile(self._attention_arrays(il))
        out = self._compiled[key](X, *tabs.scalars, *rope,
                                  *(win if R else ()), *[a for a in st.arrays() if a is not None])
        return out[0], self._unflatten(il, out[1:])

    def compiles(self, rows: int) -> bool:
        """Whether a chunk of ``rows`` runs its attention half compiled (MLX) or as a CUDA graph (CuPy)."""
        return self.compile and rows <= self.backend.compiled_rows

    def _unflatten(self, il: int, arrays) -> LayerState:
        """A layer's state from its present arrays: raw; + compressor (R ≠ 0); + indexer (R = 4). From an
        iterator it takes just the layer's arrays."""
        R = self.cfg.ratio(il)
        present = (True,) + (R != 0,) * 3 + (R == 4,) * 3
        it = iter(arrays)
        return LayerState.from_arrays([next(it) if p else None for p in present])

    def _attention_arrays(self, il: int):
        """The attention block as a function of arrays only, for ``mx.compile``."""
        R = self.cfg.ratio(il)

        def step(X, pos0, n_valid, cos, sin, *rest):
            self.trace_count += 1  # runs once per trace, not once per call
            wcos, wsin, arrays = (rest[0], rest[1], rest[2:]) if R else (None, None, rest)
            X, new = self.attention_block(il, X, pos0, n_valid, (cos, sin), (wcos, wsin), self._unflatten(il, arrays))
            return (X, *[a for a in new.arrays() if a is not None])

        return step

    def attention_block(self, il: int, X, pos0, n_valid, rope, windows, st: LayerState):
        cfg, w = self.cfg, self.w
        xp, eps, p = self.backend.xp, cfg.rms_eps, f"blk.{il}."
        C, R = X.shape[0], cfg.ratio(il)

        self._emit(p + "span", (pos0, n_valid))  # the chunk's first position and real rows (ds4lab.hooks)
        x_in, post, comb = self._hc_pre(il, "attn", X)
        self._emit(p + "hc_attn.post", post)
        self._emit(p + "hc_attn.comb", comb)
        norm = self.ops.rmsnorm
        a = norm(x_in, eps, w.vector(p + "attn_norm.weight"))
        names = self._projections_of_a(il, st)
        of_a = dict(zip(names, w.linears(*names)(a)))  # one product per weight type, not one per tensor
        qr = norm(of_a[p + "attn_q_a.weight"], eps, w.vector(p + "attn_q_a_norm.weight"))
        # q and the KV row normalised, and normalised then turned by RoPE (one launch each with kernels)
        cos, sin = rope
        norm_rope = self.ops.rmsnorm_rope
        q, q_rot = norm_rope(w.linear(p + "attn_q_b.weight")(qr).reshape(C, cfg.n_head, cfg.head_dim), eps, None,
                             cos, sin)
        kv, kv_rot = norm_rope(of_a[p + "attn_kv.weight"], eps, w.vector(p + "attn_kv_a_norm.weight"), cos, sin)
        self._emit(p + "attn_norm", a)
        self._emit(p + "attn.q_lora", qr)
        self._emit(p + "attn.q", q)
        self._emit(p + "attn.kv_in", kv)
        q, kv = q_rot, self.store_kv(kv_rot)

        # Raw ring: the chunk's rows go to slots pos mod raw_cap before attention. Slot s now holds
        # the latest position ≡ s written so far; a query sees positions in (q − window, q].
        raw, slot_pos, visible = self.ops.ring_write(st.raw, kv, pos0, n_valid, cfg.swa)
        keys, new = raw, LayerState(raw=raw)

        if R:
            # Rows of windows that end inside the chunk are written before the chunk's attention.
            comp, comp_kv, comp_sc = self._compress(il, "attn_compressor", of_a, pos0, n_valid, windows,
                                                    st.comp, st.comp_state_kv, st.comp_state_score, self.store_kv)
            new = LayerState(raw=raw, comp=comp, comp_state_kv=comp_kv, comp_state_score=comp_sc)
            n_vis, comp_visible = self.ops.compressed_visible(pos0, n_valid, C, comp.shape[0], R)
            comp_candidates = comp_visible
            if cfg.has_indexer(il):
                index, index_kv, index_sc = self._compress(
                    il, "indexer_compressor", of_a, pos0, n_valid, windows, st.index, st.index_state_kv,
                    st.index_state_score, self.store_index)
                new = LayerState(raw, comp, comp_kv, comp_sc, index, index_kv, index_sc)
                if self._indexer_selects(st):
                    score = self._indexer_scores(il, qr, of_a[p + "indexer.proj.weight"], cos, sin, index)
                    self._emit(p + "indexer.scores", score)
                    comp_visible = self.ops.indexer_allowed(score, comp_visible, n_vis, cfg.idx_topk)
                    self._emit(p + "indexer.topk", comp_visible)
            keys = xp.concatenate([raw, comp], axis=0)
            visible = xp.concatenate([visible, comp_visible], axis=1)

        if self.observer is not None:  # what ds4lab.hooks needs to materialise attention maps on request
            self._emit(p + "attn.scores", dict(
                q=q, keys=keys, visible=visible, sinks=w.vector(p + "attn_sinks.weight"), scale=cfg.head_dim ** -0.5,
                slot_pos=slot_pos, n_raw=raw.shape[0], ratio=R, comp_candidates=comp_candidates if R else None))
        out = self.ops.attend(q, keys, visible, w.vector(p + "attn_sinks.weight"), cfg.head_dim ** -0.5)
        self._emit(p + "attn.out", out)
        heads = self.ops.rope(out, cos, sin, inverse=True)
        self._emit(p + "attn.heads", heads)
        out_b = w.linear(p + "attn_output_b.weight")
        stacked = w.out_a_stacked(il)
        if stacked is not None and C * cfg.o_groups <= self.gather_max_pairs:  # a decode step: one launch
            y = grouped_output_gathered(xp, heads, stacked, cfg.o_groups, out_b)
        elif stacked is not None:  # a chunk: one batched GEMM over the groups
            y = out_b(stacked.grouped(heads.reshape(C, cfg.o_groups, -1)))
        else:
            y = grouped_output(xp, heads, w.out_a_groups(il), out_b)
        return self.ops.hc_post(y, X, post, comb), new

    def _projections_of_a(self, il: int, st: LayerState) -> list[str]:
        """The weights that multiply the attention's normed input ``a``: the query's and the KV row's, then the
        compressor's kv and gate (R ≠ 0), the indexer compressor's and, once it selects, the indexer's head
        weights (R = 4)."""
        p, R = f"blk.{il}.", self.cfg.ratio(il)
        names = [p + "attn_q_a.weight", p + "attn_kv.weight"]
        if R:
            names += [p + "attn_compressor_kv.weight", p + "attn_compressor_gate.weight"]
        if R and self.cfg.has_indexer(il):
            names += [p + "indexer_compressor_kv.weight", p + "indexer_compressor_gate.weight"]
            names += [p + "indexer.proj.weight"] if self._indexer_selects(st) else []
        return names

    def _indexer_selects(self, st: LayerState) -> bool:
        """Whether the indexer can leave a query out: not while no query can see more rows than its top-k."""
        return st.index.shape[0] > self.cfg.idx_topk

    def _compress(self, il, name, of_a, pos0, n_valid, windows, rows, state_kv, state_sc, store):
        """Take one compressor's projections of the chunk (``of_a``: by weight name), pool windows, normalize,
        RoPE at the window start, and append the rows of windows completed in the chunk."""
        cfg, w, p = self.cfg, self.w, f"blk.{il}.{name}_"
        R = cfg.ratio(il)
        ape = w.table(p + "ape.weight")  # [R, W]: the score bias of each slot in the window
        kv = of_a[p + "kv.weight"]
        sc = self.ops.add_ape(of_a[p + "gate.weight"], ape, pos0)
        self._emit(f"blk.{il}.{name}.kv", kv)
        self._emit(f"blk.{il}.{name}.score", sc)
        pooled, new_kv, new_sc = self.ops.compress_chunk(state_kv, state_sc, kv, sc, pos0, n_valid, R)
        _, c = self.ops.rmsnorm_rope(pooled, cfg.rms_eps, w.vector(p + "norm.weight"), *windows)
        c = store(c)
        rows = self.ops.append_rows(rows, c, pos0, n_valid, R)
        self._emit(f"blk.{il}.{name}.rows", rows)
        return rows, new_kv, new_sc

    def _indexer_scores(self, il, qr, proj, cos, sin, index_rows):
        """``proj``: the indexer's head weights before scaling, ``a`` times its proj weight."""
        cfg, w, p = self.cfg, self.w, f"blk.{il}.indexer."
        C = qr.shape[0]
        q = w.linear(p + "attn_q_b.weight")(qr).reshape(C, cfg.idx_heads, cfg.idx_dim)
        q = self.indexer_quant(self.ops.rope(q, cos, sin))
        weights = proj * (cfg.idx_heads * cfg.idx_dim) ** -0.5
        return self.ops.indexer_scores(q, weights, index_rows)

    # -- FFN half -------------------------------------------------------------------------------------
    def _ffn(self, il: int, X, tokens: np.ndarray, tabs: ChunkTables):
        """The FFN half; a decode-sized one as a CUDA graph where the backend graphs it (CuPy)."""
        if tabs.ids is None or self.observer is not None:
            return self.ffn_block(il, X, tokens)
        key = ("ffn", il, X.shape[0])
        if key not in self._compiled:
            self._compiled[key] = self.backend.compile(lambda X, ids: (self.ffn_block(il, X, ids),))
        return self._compiled[key](X, tabs.ids)[0]

    def ffn_block(self, il: int, X, tokens):
        """``tokens`` are host ids, or device ids where a compiled step passes them in."""
        cfg, b, w = self.cfg, self.backend, self.w
        xp, p = b.xp, f"blk.{il}."
        x_in, post, comb = self._hc_pre(il, "ffn", X)
        self._emit(p + "hc_ffn.post", post)
        self._emit(p + "hc_ffn.comb", comb)
        f = self.ops.rmsnorm(x_in, cfg.rms_eps, w.vector(p + "ffn_norm.weight"))
        logits = w.linear(p + "ffn_gate_inp.weight")(f)
        bias = w.vector(p + "exp_probs_b.bias") if p + "exp_probs_b.bias" in w else None
        stacked = w.stacked_experts(il)
        few = X.shape[0] <= DEVICE_ROUTING_ROWS
        if stacked is not None and (few or not cfg.is_hash_layer(il)):
            table = w.hash_table_on_device(il) if cfg.is_hash_layer(il) else None
            probs, selected, weights = self.ops.moe_route(logits, bias, cfg.n_expert_used, cfg.expert_weight_scale,
                                                   table, tokens)
            if not few:  # a chunk: qgemm plans its tiles from host ids
                selected = np.asarray(b.to_numpy(selected), dtype=np.int64)
        else:
            probs = router_probs(xp, logits)
            if cfg.is_hash_layer(il):
                selected = w.hash_table(il)[tokens].astype(np.int64)
            else:
                selected = select_topk(b.to_numpy(probs if bias is None else probs + bias), cfg.n_expert_used)
            weights = route_weights(xp, probs, xp.array(selected.astype(np.int32)), cfg.expert_weight_scale)
        self._emit(p + "moe.router", probs)
        self._emit(p + "moe.experts", selected)
        self._emit(p + "moe.weights", weights)
        clamp = cfg.swiglu_clamp[il]
        if stacked is not None:  # kernels: every (token, expert) pair in one launch per projection
            moe = routed_experts_gathered(self.ops, f, selected, weights, stacked, clamp)
        else:
            moe = routed_experts(self.ops, f, selected, weights, lambda e: w.expert(il, e), clamp)
        gate, up = w.linears(p + "ffn_gate_shexp.weight", p + "ffn_up_shexp.weight")(f)
        shared = w.linear(p + "ffn_down_shexp.weight")(self.ops.swiglu(gate, up, clamp))
        return self.ops.hc_post(moe + shared, X, post, comb)
