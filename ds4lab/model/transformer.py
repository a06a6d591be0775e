"""The DS4 model as math (docs/MODEL.md, "Overview"): the embedding, each layer's attention and FFN halves,
and the head, written once over a backend's ops.

Every rule is written per query position, as that section states them, so one chunk holding the whole
prompt (one-shot prefill) and chunk after chunk give the same result. A block works on fixed shapes — the
chunk's ``C`` rows (the last ones may be padding) and the state's capacities — with the chunk's start
position and its number of real tokens as inputs (host ints, or device scalars where a compiled call passes
them in), so it can be traced once per shape and reused; it returns the layer's new state and never modifies
the one it is given. How a chunk runs — the RoPE tables the blocks read, padding, compiled calls and CUDA
graphs, tiers — is :mod:`ds4lab.runtime`'s.

Hook points: each block takes ``emit``, called as ``emit(name, value)`` at the named points listed in
:mod:`ds4lab.hooks` (None: nothing is emitted, and nothing is made for it). At the editable points
(:data:`EDITABLE`) an ``emit`` that returns a :class:`Replace` makes the block use its value instead of its own
(:mod:`ds4lab.interventions`); any other return is ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np

from ..config import ModelConfig
from ..kv.layout import LayerState
from .attention import grouped_output, grouped_output_gathered, join_tail
from .hc import hc_head
from .moe import route_weights, routed_experts, routed_experts_gathered, router_probs, select_topk
from .rope import RopeParams
from .weights import HeadWeights, LayerWeights

NUMERICS = ("ds4", "exact")
GATHER_MAX_PAIRS = 64  # (token, group) pairs up to which attn_output_a runs gathered, when the backend can
# Up to this many tokens, kernel backends choose experts on the device with no host sync (a decode step can
# be a CUDA graph). A longer chunk's top-k routing runs there too, and only the chosen ids come back for
# qgemm's tiles: sorting the chunk's probabilities on the host left the GPU idle (benchmarks/README.md).
DEVICE_ROUTING_ROWS = 16
# Points whose value the observer may replace: the layer's KV state before the step, the sink logits, the
# compressed rows each query attends, the heads' outputs, the routed experts.
EDITABLE = ("attn.state", "attn.sinks", "attn.comp_visible", "attn.heads", "moe.experts")


def _in_layer(il: int, emit):
    """``emit`` with layer ``il``'s ``blk.{il}.`` in front of every point name, or None."""
    if emit is None:
        return None
    prefix = f"blk.{il}."
    return lambda name, value: emit(prefix + name, value)


@dataclass(frozen=True)
class Replace:
    """What an observer returns at an editable point to make the model use ``value`` instead of its own."""

    value: object


def _edit(emit, name: str, value):
    """``value`` after ``emit`` at an editable point: the value of the :class:`Replace` it returns, if any."""
    out = emit(name, value)
    return out.value if isinstance(out, Replace) else value


class Transformer:
    """The model over ``weights`` (a :class:`~.weights.Weights` or :class:`~.weights.ArrayWeights`) and ``ops``
    (a :class:`ds4lab.ops.Ops`: each op a kernel or its reference formula): ``layers[il]``
    (:class:`~.weights.LayerWeights`) and ``head_weights`` are made once here; the blocks compute with ``ops``
    and the backend's array library ``xp``."""

    def __init__(self, config: ModelConfig, weights, ops, numerics: str = "ds4"):
        if numerics not in NUMERICS:
            raise ValueError(f"unknown numerics {numerics!r}; choose one of {', '.join(NUMERICS)}")
        self.cfg = config
        self.ops = ops  # attend, rope, rmsnorm, hc_pre, ...
        self.backend = ops.backend  # the array library (xp, to_numpy)
        self.xp = ops.xp
        self.numerics = numerics
        # How attn_output_a is multiplied (the same product, as one gathered launch or a batched GEMM): a
        # choice of the math's kernels, like the ops' own, made per block from its row count.
        self.gather_max_pairs = GATHER_MAX_PAIRS
        self.ropes = tuple(RopeParams.for_layer(config, il) for il in range(config.n_layer))
        self.weights = weights

    @property
    def weights(self):
        """The tensors by GGUF name; setting it binds ``layers`` and ``head_weights`` to the new source (a
        trainer binds its parameters for each step)."""
        return self._weights

    @weights.setter
    def weights(self, source) -> None:
        self._weights = source
        self.layers = tuple(LayerWeights(source, self.cfg, il) for il in range(self.cfg.n_layer))
        self.head_weights = HeadWeights(source)

    # -- numerics (docs/MODEL.md, "Numerics") ----------------------------------------------------------
    def store_kv(self, x):
        """FP8 on the non-RoPE dims, then F16 rounding, as every cached attention row is stored."""
        return x if self.numerics == "exact" else self.ops.store_kv(x, self.cfg.n_rot)

    def store_index(self, x):
        """Hadamard + FP4, then F16 rounding, as every indexer row is stored."""
        return x if self.numerics == "exact" else self.ops.hadamard_fp4(x, f16=True)

    # -- embedding and head ----------------------------------------------------------------------------
    def embed(self, tokens: np.ndarray):
        """The HC state ``[T, n_hc, E]`` of host token ids: each token's embedding row in every stream."""
        return self._streams(self.weights.embed(tokens))

    def embed_on_device(self, ids):
        """:meth:`embed` of device int32 ids (a compiled step's), looked up and decoded on the device."""
        return self._streams(self.weights.embed_on_device(ids))

    def _streams(self, emb):
        return self.xp.broadcast_to(emb[:, None, :], (emb.shape[0], self.cfg.n_hc, self.cfg.n_embd))

    def head(self, X, emit=None):
        """Logits ``[T, vocab]`` from the final HC state (docs/MODEL.md, "The head"); emitted as ``head.logits``."""
        cfg, hw = self.cfg, self.head_weights
        emb = hc_head(self.ops, X, hw.output_hc_fn, hw.output_hc_scale, hw.output_hc_base, eps=cfg.hc_eps,
                      norm_eps=cfg.rms_eps)
        logits = hw.output(self.ops.rmsnorm(emb, cfg.rms_eps, hw.output_norm))
        if emit:
            emit("head.logits", logits)
        return logits

    def _hc_pre(self, hc, X, norm_weight, quiet: bool, then=None):
        """(rmsnorm(x_in, norm_weight), post, comb, mixer): the hyper-connection mixer before a sublayer (see
        :func:`.hc.hc_pre`) and the sublayer's input norm; ``mixer.join()`` before post and comb are read (with
        ``quiet`` they may be made beside the sublayer: Ops.hc_pre); ``then``, the sublayer's first linear, may be
        started there."""
        cfg = self.cfg
        return self.ops.hc_pre(X, hc.fn, hc.scale, hc.base, iters=cfg.sinkhorn_iters, eps=cfg.hc_eps,
                               norm_eps=cfg.rms_eps, norm_weight=norm_weight, quiet=quiet, then=then)

    # -- attention half -------------------------------------------------------------------------------
    def attention_block(self, il: int, X, pos0, n_valid, rope, windows, st: LayerState, emit=None,
                        chain: bool = False):
        """Layer ``il``'s attention half on the HC state ``X [C, n_hc, E]`` of positions ``pos0 …``, of which the
        first ``n_valid`` rows are real: ``(X, the layer's new state)``. ``rope``: the chunk's (cos, sin);
        ``windows``: those of the start positions of the compressed windows the chunk can complete, or None when
        it ends none of this layer's windows (a decode step, most of the time): then the compressors only move
        their pending state on, and their pooling, its norm and the rows' append are left out. ``chain``: the FFN
        half runs next on the X returned, in the same call (a whole step's), so its mixer may be started here
        (:meth:`ds4lab.ops.Ops.hc_post`'s ``then``)."""
        cfg, ops, lw, xp = self.cfg, self.ops, self.layers[il], self.xp
        eps, C, R = cfg.rms_eps, X.shape[0], cfg.ratio(il)
        emit = _in_layer(il, emit)

        sinks = lw.attn_sinks
        if emit:
            emit("span", (pos0, n_valid))  # the chunk's first position and real rows (ds4lab.hooks)
            st = _edit(emit, "attn.state", st)
            sinks = _edit(emit, "attn.sinks", sinks)
        a, post, comb, mixer = self._hc_pre(lw.hc_attn, X, lw.attn_norm, emit is None)
        if emit:
            emit("hc_attn.post", post)
            emit("hc_attn.comb", comb)
        selects = bool(R) and cfg.has_indexer(il) and self._indexer_selects(st)
        q_a, kv_a = ops.split_sums(lw.query_projections, a)  # as the norms read them: K splits on kernel backends
        cos, sin = rope
        # The KV row and the raw ring, and the compressors (their products of a, then their pooled rows) do not need q:
        # for a decode step's few rows each chain runs beside q's projections and beside the other, the indexer's
        # compressor beside the attention rows', forked once its products are made, and the indexer's queries beside
        # q's, then its selection once both compressors' rows are made (ops.branch: side streams on CuPy, in order
        # elsewhere), until the attention reads the rows they make; the mixer's post and comb (hc_pre's branch) beside
        # all of it, until hc_post.
        kv_side = ops.branch(C, emit is None)
        with kv_side:
            # kv_a stays held: a side stream reads it, and memory freed on the main stream is reused there at once
            kv, kv_rot = ops.rmsnorm_rope(kv_a, eps, lw.attn_kv_a_norm, cos, sin)
        comp_side = ops.branch(C, emit is None)
        with comp_side:
            of_a = lw.compressor_projections(a, selects)
            index_side = ops.branch(C, emit is None)
            if selects:  # the indexer's head weights, scaled
                w_idx = of_a.index_proj * (cfg.idx_heads * cfg.idx_dim) ** -0.5
        # q normalised, and normalised then turned by RoPE (one launch with kernels)
        qr = ops.rmsnorm(q_a, eps, lw.attn_q_a_norm)
        if selects:  # the indexer's queries read qr alone: beside q's projection, not after it
            query_side = ops.branch(C, emit is None)
            with query_side:
                q_idx = self._indexer_query(lw, qr, cos, sin)
        q, q_rot = ops.rmsnorm_rope(lw.attn_q_b(qr).reshape(C, cfg.n_head, cfg.head_dim), eps, None, cos, sin)
        if emit:
            emit("attn_norm", a)
            emit("attn.q_lora", qr)
            emit("attn.q", q)
            emit("attn.kv_in", kv)
        q = q_rot

        with kv_side:
            # Raw ring: the chunk's rows go to slots pos mod raw_cap before attention. Slot s now holds
            # the latest position ≡ s written so far; a query sees positions in (q − window, q].
            raw, slot_pos, visible = ops.ring_write(st.raw, self.store_kv(kv_rot), pos0, n_valid, cfg.swa)
        new, comp_candidates, tail = LayerState(raw=raw), None, None

        if R:
            # Rows of windows that end inside the chunk are written before the chunk's attention.
            with comp_side:
                comp, comp_kv, comp_sc = self._compress(
                    "attn_compressor", lw.attn_compressor, of_a.comp_kv, of_a.comp_gate, R, pos0, n_valid, windows,
                    (st.comp, st.comp_state_kv, st.comp_state_score), self.store_kv, emit)
                n_vis, comp_visible = ops.compressed_visible(pos0, n_valid, C, comp.shape[0], R)
            new = LayerState(raw=raw, comp=comp, comp_state_kv=comp_kv, comp_state_score=comp_sc)
            comp_candidates = comp_visible
            if cfg.has_indexer(il):
                with index_side:
                    index, index_kv, index_sc = self._compress(
                        "indexer_compressor", lw.indexer_compressor, of_a.index_kv, of_a.index_gate, R, pos0,
                        n_valid, windows, (st.index, st.index_state_kv, st.index_state_score), self.store_index, emit)
                new = LayerState(raw, comp, comp_kv, comp_sc, index, index_kv, index_sc)
                if selects:  # on the queries' branch, once the compressors' rows are made: not after q's product
                    with query_side:
                        query_side.after(index_side)
                        query_side.after(comp_side)
                        score = ops.indexer_scores(q_idx, w_idx, index)
                        if emit:
                            emit("indexer.scores", score)
                        comp_visible = ops.indexer_allowed(score, comp_visible, n_vis, cfg.idx_topk)
                        if emit:
                            emit("indexer.topk", comp_visible)
                    query_side.join()
            if emit:
                comp_visible = _edit(emit, "attn.comp_visible", comp_visible)
            tail = (comp, comp_visible)  # the keys after the raw window
        index_side.join()
        comp_side.join()
        kv_side.join()

        scale = cfg.head_dim ** -0.5
        if emit:  # what ds4lab.hooks needs to materialise attention maps on request, and the output before RoPE
            keys, vis = join_tail(xp, raw, visible, tail)
            emit("attn.scores", dict(q=q, keys=keys, visible=vis, sinks=sinks, scale=scale,
                                     slot_pos=slot_pos, n_raw=raw.shape[0], ratio=R, comp_candidates=comp_candidates))
            out = ops.attend(q, raw, visible, sinks, scale, tail)
            emit("attn.out", out)
            heads = _edit(emit, "attn.heads", ops.rope(out, cos, sin, inverse=True))
        else:  # the output turned back by RoPE as the attention writes it (one launch with kernels)
            heads = ops.attend_rope(q, raw, visible, sinks, scale, tail, cos, sin)
        out_b = partial(ops.split_sums, lw.attn_output_b)  # hc_post adds its K splits
        stacked = lw.attn_output_a_stacked
        if stacked is not None and C * cfg.o_groups <= self.gather_max_pairs:  # a decode step: one launch
            y = grouped_output_gathered(xp, heads, stacked, cfg.o_groups, out_b)
        elif stacked is not None:  # a chunk: one batched GEMM over the groups
            y = out_b(stacked.grouped(heads.reshape(C, cfg.o_groups, -1)))
        else:
            y = grouped_output(xp, heads, lw.attn_output_a_groups, out_b)
        mixer.join()
        return ops.hc_post(y, X, post, comb, then=lw.hc_ffn.fn if chain else None), new

    def _indexer_selects(self, st: LayerState) -> bool:
        """Whether the indexer can leave a query out: not while no query can see more rows than its top-k."""
        return st.index.shape[0] > self.cfg.idx_topk

    def _compress(self, name, cw, kv, gate, R, pos0, n_valid, windows, state, store, emit):
        """One compressor (``name``, its weights ``cw``) over the chunk's projections ``kv`` and ``gate``: pool
        windows, normalize, RoPE at the window start (``windows``: their cos, sin; None when the chunk ends no
        window), and append the rows of windows completed in the chunk to ``state`` = (rows, pending kv, pending
        score); returns the three after the chunk."""
        ops = self.ops
        rows, state_kv, state_sc = state
        sc = ops.add_ape(gate, cw.ape, pos0)
        if emit:
            emit(name + ".kv", kv)
            emit(name + ".score", sc)
        if windows is None:  # no window ends in the chunk: the rows stay as they are
            new_kv, new_sc = ops.compress_state(state_kv, state_sc, kv, sc, pos0, n_valid, R)
        else:
            pooled, new_kv, new_sc = ops.compress_chunk(state_kv, state_sc, kv, sc, pos0, n_valid, R)
            _, c = ops.rmsnorm_rope(pooled, self.cfg.rms_eps, cw.norm, *windows)
            rows = ops.append_rows(rows, store(c), pos0, n_valid, R)
        if emit:
            emit(name + ".rows", rows)
        return rows, new_kv, new_sc

    def _indexer_query(self, lw: LayerWeights, qr, cos, sin):
        """The indexer's queries: turned by RoPE, then (but in exact numerics) its Hadamard + FP4 step, one launch with
        kernels."""
        cfg = self.cfg
        q = lw.indexer_attn_q_b(qr).reshape(qr.shape[0], cfg.idx_heads, cfg.idx_dim)
        if self.numerics == "exact":
            return self.ops.rope(q, cos, sin)
        return self.ops.hadamard_fp4(q, rope=(cos, sin))

    # -- FFN half -------------------------------------------------------------------------------------
    def ffn_block(self, il: int, X, tokens, emit=None, chain: bool = False):
        """Layer ``il``'s FFN half on the real rows ``X``; ``tokens`` are their host ids, or device ids where a
        compiled call passes them in. ``chain``: the next layer's attention half runs next on the X returned, in the
        same call, so its mixer may be started here."""
        cfg, ops, lw, xp = self.cfg, self.ops, self.layers[il], self.xp
        emit = _in_layer(il, emit)
        f, post, comb, mixer = self._hc_pre(lw.hc_ffn, X, lw.ffn_norm, emit is None, then=lw.ffn_gate_inp)
        if emit:
            emit("hc_ffn.post", post)
            emit("hc_ffn.comb", comb)
            emit("ffn_norm", f)
        clamp = cfg.swiglu_clamp[il]
        shared_side = ops.branch(X.shape[0], emit is None)  # the shared expert beside the routed ones (ops.branch)
        with shared_side:
            gate, up = lw.ffn_gate_up_shexp(f)
            shared = lw.ffn_down_shexp(ops.swiglu(gate, up, clamp))
        bias, stacked = lw.exp_probs_b, lw.experts_stacked
        few, hashed = X.shape[0] <= DEVICE_ROUTING_ROWS, cfg.is_hash_layer(il)
        if stacked is not None and (few or not hashed):
            logits = ops.split_sums(lw.ffn_gate_inp, f)  # moe_route adds the K splits
            table = lw.hash_table_on_device if hashed else None
            probs, selected, weights = ops.moe_route(logits, bias, cfg.n_expert_used, cfg.expert_weight_scale,
                                                     table, tokens)
            if not few:  # a chunk: qgemm plans its tiles from host ids
                selected = np.asarray(self.backend.to_numpy(selected), dtype=np.int64)
        else:
            logits = lw.ffn_gate_inp(f)
            probs = router_probs(xp, logits)
            if hashed:
                selected = lw.hash_table[tokens].astype(np.int64)
            else:
                selected = select_topk(self.backend.to_numpy(probs if bias is None else probs + bias),
                                       cfg.n_expert_used)
            weights = route_weights(xp, probs, xp.array(selected.astype(np.int32)), cfg.expert_weight_scale)
        if emit:
            emit("moe.router", probs)
            chosen = _edit(emit, "moe.experts", selected)
            if chosen is not selected:  # other experts: weighted by the router's probabilities of those
                selected = np.asarray(chosen, dtype=np.int64)
                weights = route_weights(xp, probs, xp.array(selected.astype(np.int32)), cfg.expert_weight_scale)
            emit("moe.weights", weights)
        if stacked is not None:  # kernels: every (token, expert) pair in one launch per projection, a token's rows
            moe = routed_experts_gathered(ops, f, selected, weights, stacked, clamp, emit is None)
            pairs = selected.shape[1]
        else:
            moe, pairs = routed_experts(ops, f, selected, weights, lw.expert, clamp), 1
        if emit:
            moe, pairs = (ops.pair_sum(moe, pairs) if pairs > 1 else moe), 1
            emit("moe.out", moe)
        shared_side.join()
        mixer.join()
        then = self.layers[il + 1].hc_attn.fn if chain and il + 1 < cfg.n_layer else None  # the next mixer
        return ops.hc_post(moe, X, post, comb, pairs, shared, then)  # it adds a token's rows, then the shared expert
