"""The DS4 forward pass over a chunk of tokens (spec §3), written once over a backend.

``forward(tokens, cache)`` runs positions ``cache.n_past …`` through every layer and returns the final
HC state and a new cache; the input cache is never modified, so a failed chunk leaves nothing half
updated. One chunk holding the whole prompt is the one-shot prefill; chunk after chunk gives the same
result because every rule below is written per query position (§3.12).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np

from ..config import ModelConfig
from ..quants import dequantize
from . import numerics as nx
from .attention import (attend_with_sinks, compressed_visibility, grouped_output, indexer_allowed,
                        indexer_scores, raw_visibility)
from .compressor import CompressorState, compress, initial_state
from .functional import rmsnorm
from .hc import hc_head, hc_post, hc_pre
from .moe import route_weights, router_probs, routed_experts, select_topk, swiglu
from .rope import RopeParams, rope_tail

NUMERICS = ("ds4", "exact")


@dataclass(frozen=True)
class LayerCache:
    raw: object  # [≤ swa−1, D] the raw rows a later query can still see, oldest first
    comp: object | None = None  # [n_comp, D] compressed attention rows
    comp_state: CompressorState | None = None
    index: object | None = None  # [n_comp, idx_dim] compressed indexer rows (ratio 4)
    index_state: CompressorState | None = None


    def map_arrays(self, fn) -> "LayerCache":
        def one(x):
            if isinstance(x, CompressorState):
                return CompressorState(fn(x.kv), fn(x.sc), x.start_window)
            return None if x is None else fn(x)

        return LayerCache(**{f.name: one(getattr(self, f.name)) for f in fields(self)})


@dataclass(frozen=True)
class Cache:
    layers: tuple[LayerCache, ...]
    n_past: int = 0

    def to_backend(self, backend) -> "Cache":
        """The same state as arrays of ``backend`` (e.g. a float64 reference state continued in MLX)."""
        convert = lambda x: backend.asarray(np.asarray(x))  # noqa: E731
        return replace(self, layers=tuple(layer.map_arrays(convert) for layer in self.layers))


class Transformer:
    def __init__(self, config: ModelConfig, file, backend, numerics: str = "ds4"):
        if numerics not in NUMERICS:
            raise ValueError(f"unknown numerics {numerics!r}; choose one of {', '.join(NUMERICS)}")
        self.cfg = config
        self.file = file
        self.backend = backend
        self.numerics = numerics
        self.ropes = [RopeParams.for_layer(config, il) for il in range(config.n_layer)]
        self._weights: dict[str, object] = {}
        # Called as observer(name, value) at the named points below when set; the seed of the capture API.
        self.observer = None

    def _emit(self, name: str, value) -> None:
        if self.observer is not None:
            self.observer(name, value)

    # -- weights -------------------------------------------------------------------------------------
    def _info(self, name):
        return self.file.tensors[name]

    def linear(self, name: str):
        if name not in self._weights:
            t = self._info(name)
            self._weights[name] = self.backend.linear(t.data, t.qtype, t.shape[0])
        return self._weights[name]

    def vector(self, name: str):
        if name not in self._weights:
            t = self._info(name)
            self._weights[name] = self.backend.asarray(dequantize(t.data, t.qtype, t.shape[0]).reshape(-1))
        return self._weights[name]

    def table(self, name: str):
        """A small 2-D tensor as a dense ``[ne1, ne0]`` backend array (compressor APE)."""
        if name not in self._weights:
            t = self._info(name)
            self._weights[name] = self.backend.asarray(dequantize(t.data, t.qtype, t.shape[0]))
        return self._weights[name]

    def out_a_groups(self, il: int):
        key = f"blk.{il}.attn_output_a.groups"
        if key not in self._weights:
            t = self._info(f"blk.{il}.attn_output_a.weight")
            rows = self.cfg.o_lora
            self._weights[key] = [self.backend.linear(t.data[g * rows:(g + 1) * rows], t.qtype, t.shape[0])
                                  for g in range(self.cfg.o_groups)]
        return self._weights[key]

    def expert(self, il: int, e: int):
        """Gate, up and down of routed expert ``e``, dequantized from that expert's blocks only."""
        def one(kind):
            t = self._info(f"blk.{il}.ffn_{kind}_exps.weight")
            return self.backend.linear(t.data[e], t.qtype, t.shape[0])

        return one("gate"), one("up"), one("down")

    def hash_table(self, il: int) -> np.ndarray:
        t = self._info(f"blk.{il}.ffn_gate_tid2eid.weight")
        return dequantize(t.data, t.qtype, t.shape[0])

    def embed(self, tokens: np.ndarray):
        t = self._info("token_embd.weight")
        return self.backend.asarray(dequantize(t.data[tokens], t.qtype, t.shape[0]))

    # -- numerics (spec §4.1) -------------------------------------------------------------------------
    def store_kv(self, x):
        """FP8 on the non-RoPE dims, then F16 rounding, as every cached attention row is stored."""
        if self.numerics == "exact":
            return x
        xp = self.backend.xp
        return nx.f16_round(xp, nx.fp8_kv_sim(xp, x, self.cfg.n_rot))

    def indexer_quant(self, x):
        return x if self.numerics == "exact" else nx.hadamard_fp4_sim(self.backend.xp, x)

    def store_index(self, x):
        return x if self.numerics == "exact" else nx.f16_round(self.backend.xp, self.indexer_quant(x))

    # -- cache ----------------------------------------------------------------------------------------
    def new_cache(self) -> Cache:
        cfg, b = self.cfg, self.backend
        empty = lambda d: b.xp.zeros((0, d), dtype=b.dtype)  # noqa: E731
        layers = []
        for il in range(cfg.n_layer):
            R = cfg.ratio(il)
            layer = LayerCache(raw=empty(cfg.head_dim))
            if R:
                layer = replace(layer, comp=empty(cfg.head_dim),
                                comp_state=initial_state(b, R, cfg.compressor_width(il, cfg.head_dim)))
            if cfg.has_indexer(il):
                layer = replace(layer, index=empty(cfg.idx_dim),
                                index_state=initial_state(b, R, cfg.compressor_width(il, cfg.idx_dim)))
            layers.append(layer)
        return Cache(tuple(layers), 0)

    # -- forward --------------------------------------------------------------------------------------
    def forward(self, tokens, cache: Cache):
        """Run ``tokens`` at positions ``cache.n_past …``; returns ``(X [T, n_hc, E], new cache)``."""
        cfg, xp = self.cfg, self.backend.xp
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.ndim != 1 or len(tokens) == 0:
            raise ValueError("forward needs a non-empty 1-D sequence of token ids")
        if tokens.min() < 0 or tokens.max() >= cfg.n_vocab:
            bad = int(tokens[(tokens < 0) | (tokens >= cfg.n_vocab)][0])
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {cfg.n_vocab})")
        positions = cache.n_past + np.arange(len(tokens))
        e = self.embed(tokens)
        X = xp.broadcast_to(e[:, None, :], (len(tokens), cfg.n_hc, cfg.n_embd))
        layers = []
        for il in range(cfg.n_layer):
            X, layer = self.attention_block(il, X, positions, cache.layers[il])
            X = self.ffn_block(il, X, tokens)
            layers.append(layer)
        return X, Cache(tuple(layers), cache.n_past + len(tokens))

    def head(self, X):
        """Logits ``[T, vocab]`` from the final HC state (§3.11)."""
        cfg, xp = self.cfg, self.backend.xp
        emb = hc_head(xp, X, self.linear("output_hc_fn.weight"), self.vector("output_hc_scale.weight"),
                      self.vector("output_hc_base.weight"), eps=cfg.hc_eps, norm_eps=cfg.rms_eps)
        return self.linear("output.weight")(rmsnorm(xp, emb, cfg.rms_eps, self.vector("output_norm.weight")))

    def _hc_pre(self, il: int, sub: str, X):
        p = f"blk.{il}.hc_{sub}_"
        return hc_pre(self.backend.xp, X, self.linear(p + "fn.weight"), self.vector(p + "scale.weight"),
                      self.vector(p + "base.weight"), iters=self.cfg.sinkhorn_iters, eps=self.cfg.hc_eps,
                      norm_eps=self.cfg.rms_eps)

    def _rope(self, il: int, positions: np.ndarray):
        cos, sin = self.ropes[il].tables(positions)
        return self.backend.asarray(cos), self.backend.asarray(sin)

    def attention_block(self, il: int, X, positions: np.ndarray, cache: LayerCache):
        cfg, b = self.cfg, self.backend
        xp, eps, p = b.xp, cfg.rms_eps, f"blk.{il}."
        T, R = len(positions), cfg.ratio(il)

        x_in, post, comb = self._hc_pre(il, "attn", X)
        a = rmsnorm(xp, x_in, eps, self.vector(p + "attn_norm.weight"))
        qr = rmsnorm(xp, self.linear(p + "attn_q_a.weight")(a), eps, self.vector(p + "attn_q_a_norm.weight"))
        q = rmsnorm(xp, self.linear(p + "attn_q_b.weight")(qr).reshape(T, cfg.n_head, cfg.head_dim), eps)
        kv = rmsnorm(xp, self.linear(p + "attn_kv.weight")(a), eps, self.vector(p + "attn_kv_a_norm.weight"))
        self._emit(p + "attn_norm", a)
        self._emit(p + "attn.q_lora", qr)
        self._emit(p + "attn.q", q)
        self._emit(p + "attn.kv_in", kv)
        cos, sin = self._rope(il, positions)
        q = rope_tail(xp, q, cos, sin)
        kv = self.store_kv(rope_tail(xp, kv, cos, sin))

        # Raw window: earlier rows still in reach, then this chunk's rows (pushed before attention).
        raw = xp.concatenate([cache.raw, kv], axis=0)
        raw_pos = positions[0] - cache.raw.shape[0] + np.arange(raw.shape[0])
        keys, visible = raw, raw_visibility(positions, raw_pos, cfg.swa)
        new_cache = replace(cache, raw=raw[max(0, raw.shape[0] - (cfg.swa - 1)):])

        if R:
            # Rows of windows that end inside the chunk are emitted before the chunk's attention.
            comp, comp_state = self._compress(il, "attn_compressor_", a, positions, cache.comp, cache.comp_state,
                                              cfg.head_dim, self.store_kv)
            new_cache = replace(new_cache, comp=comp, comp_state=comp_state)
            comp_visible = compressed_visibility(positions, comp.shape[0], R)
            comp_visible = xp.array(comp_visible)
            if cfg.has_indexer(il):
                index, index_state = self._compress(il, "indexer_compressor_", a, positions, cache.index,
                                                    cache.index_state, cfg.idx_dim, self.store_index)
                new_cache = replace(new_cache, index=index, index_state=index_state)
                n_visible = (positions + 1) // R
                if n_visible.max() > cfg.idx_topk:
                    score = self._indexer_scores(il, qr, a, cos, sin, index)
                    self._emit(p + "indexer.scores", score)
                    comp_visible = indexer_allowed(xp, score, comp_visible, n_visible, cfg.idx_topk)
            keys = xp.concatenate([raw, comp], axis=0)
            visible = xp.concatenate([xp.array(visible), comp_visible], axis=1)
        else:
            visible = xp.array(visible)

        out = attend_with_sinks(xp, q, keys, visible, self.vector(p + "attn_sinks.weight"), cfg.head_dim ** -0.5)
        heads = rope_tail(xp, out, cos, sin, inverse=True)
        self._emit(p + "attn.heads", heads)
        y = grouped_output(xp, heads, self.out_a_groups(il), self.linear(p + "attn_output_b.weight"))
        return hc_post(xp, y, X, post, comb), new_cache

    def _compress(self, il, prefix, a, positions, rows, state, dim, store):
        """Project the chunk for one compressor, pool finished windows, normalize, RoPE at the window start."""
        cfg, xp, p = self.cfg, self.backend.xp, f"blk.{il}.{prefix}"
        R = cfg.ratio(il)
        ape = self.table(p + "ape.weight")  # [R, W]: the score bias of each slot in the window
        kv = self.linear(p + "kv.weight")(a)
        sc = self.linear(p + "gate.weight")(a) + ape[xp.array(positions % R)]
        self._emit(p.rstrip("_") + ".kv", kv)
        self._emit(p.rstrip("_") + ".score", sc)
        pooled, first, state = compress(xp, state, kv, sc, int(positions[-1]) + 1, R)
        if pooled is None:
            return rows, state
        c = rmsnorm(xp, pooled, cfg.rms_eps, self.vector(p + "norm.weight"))
        cos, sin = self._rope(il, (first + np.arange(pooled.shape[0])) * R)
        c = store(rope_tail(xp, c, cos, sin))
        return xp.concatenate([rows, c], axis=0), state

    def _indexer_scores(self, il, qr, a, cos, sin, index_rows):
        cfg, xp, p = self.cfg, self.backend.xp, f"blk.{il}.indexer."
        T = qr.shape[0]
        q = self.linear(p + "attn_q_b.weight")(qr).reshape(T, cfg.idx_heads, cfg.idx_dim)
        q = self.indexer_quant(rope_tail(xp, q, cos, sin))
        w = self.linear(p + "proj.weight")(a) * (cfg.idx_heads * cfg.idx_dim) ** -0.5
        return indexer_scores(xp, q, w, index_rows)

    def ffn_block(self, il: int, X, tokens: np.ndarray):
        cfg, b = self.cfg, self.backend
        xp, p = b.xp, f"blk.{il}."
        x_in, post, comb = self._hc_pre(il, "ffn", X)
        f = rmsnorm(xp, x_in, cfg.rms_eps, self.vector(p + "ffn_norm.weight"))
        probs = router_probs(xp, self.linear(p + "ffn_gate_inp.weight")(f))
        if cfg.is_hash_layer(il):
            selected = self.hash_table(il)[tokens].astype(np.int64)
        else:
            bias = p + "exp_probs_b.bias"
            scores = probs + self.vector(bias) if bias in self.file.tensors else probs
            selected = select_topk(b.to_numpy(scores), cfg.n_expert_used)
        self._emit(p + "moe.experts", selected)
        weights = route_weights(xp, probs, xp.array(selected.astype(np.int32)), cfg.expert_weight_scale)
        clamp = cfg.swiglu_clamp[il]
        moe = routed_experts(b, f, selected, weights, lambda e: self.expert(il, e), clamp)
        shared = self.linear(p + "ffn_down_shexp.weight")(
            swiglu(xp, self.linear(p + "ffn_gate_shexp.weight")(f), self.linear(p + "ffn_up_shexp.weight")(f), clamp))
        return hc_post(xp, moe + shared, X, post, comb)
