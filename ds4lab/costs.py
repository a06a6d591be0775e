"""What a chunk costs, from the model's dimensions alone: FLOPs by part of the model, bytes of weights read (by
the tensors' storage types in the GGUF), KV bytes read and written, and the peak activation memory of the
reference path. None of it depends on the machine, so it can stand beside measured times, which on a shared CPU
are mostly noise.

A chunk is ``n`` tokens at positions ``start … start + n − 1`` of a session of ``ctx`` tokens. FLOPs count two
per multiply-add of the products; elementwise work (norms, softmaxes, Sinkhorn, RoPE, the FP8/FP4 roundings)
is left out: it is a few percent of a layer at any size. Each part of :data:`PARTS` is the sum of products that
multiply a weight matrix (``ChunkCost.weight_flops``: what the backend's linears do) and products of
activations (attention scores and values, the indexer's scores, the compressors' pooling, the
hyper-connections' mixing):

- attention projections: q_a, q_b, the KV row, the grouped output (attn_output_a) and attn_output_b;
- compressors: the kv and gate projections of every compressor (ratio 4 and 128, and the indexer's on ratio 4),
  and the softmax pooling of each row the chunk completes (``coff·R`` candidates);
- indexer: its query (indexer.attn_q_b) and head weights (indexer.proj), and each query's scores against the
  indexer rows it sees; they run once some query of the chunk sees more than ``idx_topk`` rows, as in ds4;
- attention: each query's scores and weighted values over the keys it sees: its raw window (``swa`` positions,
  itself included), its compressed rows (on ratio-4 layers at most ``idx_topk``, the indexer's choice); the sink
  is a logit without a value (no product);
- routed experts: the router and each token's ``n_expert_used`` experts (gate, up, down);
- shared expert: gate, up, down;
- hyper-connections: the two mixers' linears per layer, the stream collapse, and the post/combine mixing;
- output head: the head's stream collapse and the output projection, for the chunk's last token (a prefill
  needs the logits of its last position only).

Weights read: every tensor once per chunk, except the embedding and the hash tables (the chunk's tokens' rows)
and the routed experts (at most ``min(n·k, n_expert)`` distinct experts per layer: every expert for a long
chunk, exactly ``k`` for one token). KV bytes written: the rows the chunk appends (its raw rows, and the
compressed and indexer rows it completes), at ``kv_bytes_per_value`` (4: the float32 a session and ds4's
payload hold). The activation peak is that of ds4lab's reference formulas (:func:`activation_bytes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gguf import GGMLQuantizationType as Q

from .arch import coff
from .config import ModelConfig, check_count
from .gguf_file import tensor_byte_shape
from .kv.layout import graph_caps, layer_comp_cap

PARTS = ("attention projections", "compressors", "indexer", "attention", "routed experts", "shared expert",
         "hyper-connections", "output head")
KV_BYTES_PER_VALUE = 4  # float32 rows, as a session and ds4's DSV4 payload hold them
ACTIVATION_ITEMSIZE = 8  # the numpy reference backend computes in float64
EXPERT_SUFFIXES = ("_exps.weight",)
PER_TOKEN_ROWS = ("token_embd.weight", "tid2eid.weight")  # a chunk reads its tokens' rows of these only


# -- storage types ---------------------------------------------------------------------------------------------
def q2_types(cfg: ModelConfig) -> dict[str, Q]:
    """The GGML type of every tensor of ``cfg`` in the real Flash "q2" files (docs/FORMATS.md, "GGUF model files"):
    Q8_0 dense projections, IQ2_XXS routed gate/up, Q2_K routed down, F16 for the tensors stored as half, F32
    where only F32 is allowed, I32 hash tables."""
    out = {}
    for name, (_, allowed, required) in cfg.tensor_specs().items():
        if not required and cfg.is_hash_layer(int(name.split(".")[1])):
            continue  # the router bias: hash layers have none
        if name.endswith("ffn_down_exps.weight"):
            out[name] = Q.Q2_K
        elif name.endswith(EXPERT_SUFFIXES):
            out[name] = Q.IQ2_XXS
        elif Q.Q8_0 in allowed:
            out[name] = Q.Q8_0
        elif Q.F16 in allowed:
            out[name] = Q.F16
        else:
            out[name] = next(iter(allowed))  # F32 or I32, the one type allowed
    return out


def file_types(model_file) -> dict[str, Q]:
    """The GGML type of every tensor of an opened GGUF (``model.file``)."""
    return {name: t.qtype for name, t in model_file.tensors.items()}


def float_weight_bytes(model_file, itemsize: int) -> int:
    """Bytes the weights of an opened GGUF take converted to floats of ``itemsize`` bytes, as a backend without
    kernels keeps them once used (the numpy backend: float64): every tensor but the routed experts (converted one
    expert at a time into a bounded cache) and the token embedding (read by rows)."""
    return itemsize * sum(math.prod(t.shape) for name, t in model_file.tensors.items()
                          if not name.endswith(EXPERT_SUFFIXES) and name != "token_embd.weight")


def tensor_nbytes(shape, qtype) -> int:
    """Bytes a tensor of GGUF dims ``shape`` (ne0 first) takes stored as ``qtype``."""
    return math.prod(tensor_byte_shape(tuple(shape), Q(qtype)))


def weight_nbytes(cfg: ModelConfig, types: dict[str, Q]) -> dict[str, int]:
    """``name -> bytes`` of every tensor ``types`` names, its shape from ``cfg``."""
    specs = cfg.tensor_specs()
    unknown = sorted(set(types) - set(specs))
    if unknown:
        raise ValueError(f"tensor {unknown[0]} is not part of a model of this config")
    return {name: tensor_nbytes(specs[name][0], qtype) for name, qtype in types.items()}


# -- one chunk ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChunkCost:
    start: int
    tokens: int
    flops: dict  # part -> FLOPs (PARTS)
    weight_flops: dict  # part -> the FLOPs of products with a weight matrix (the backend's linears)
    weight_bytes: int  # bytes of weights read
    kv_bytes_read: int  # KV rows the chunk's attention and indexer read, each once
    kv_bytes_written: int  # KV rows the chunk writes
    kv_bytes_growth: int  # how much the cache grows: the rows written less the raw rows they overwrite
    activation_bytes: int  # peak activation memory of the reference path

    @property
    def total_flops(self) -> int:
        return sum(self.flops.values())

    @property
    def bytes_moved(self) -> int:
        """Weights read plus KV read and written."""
        return self.weight_bytes + self.kv_bytes_read + self.kv_bytes_written

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved."""
        return self.total_flops / self.bytes_moved


def _check(cfg, start: int, n: int, ctx: int, **sizes) -> None:
    """The chunk's positions within the context, and each of ``sizes`` (chunk, bytes per value, ...) a whole
    number >= 1 (0 or -5 priced nothing, or less than nothing)."""
    if not isinstance(cfg, ModelConfig):  # a Model for its config failed on an attribute
        raise TypeError(f"the first argument is a ModelConfig (model.config), not {type(cfg).__name__}")
    for name, value in dict(start=start, n=n, ctx=ctx, **sizes).items():
        check_count(value, name, least=0 if name == "start" else 1)
    if start + n > ctx:
        raise ValueError(f"positions {start}…{start + n - 1} exceed the context of {ctx} tokens")


def _sum_visible(start: int, n: int, rows_of) -> int:
    """Σ over the chunk's queries q of ``rows_of(q)`` (the keys or rows query q sees)."""
    return sum(rows_of(q) for q in range(start, start + n))


def chunk_cost(cfg: ModelConfig, start: int, n: int, types: dict[str, Q] | None = None, ctx: int | None = None,
               chunk: int | None = None, kv_bytes_per_value: int = KV_BYTES_PER_VALUE,
               activation_itemsize: int = ACTIVATION_ITEMSIZE) -> ChunkCost:
    """The cost of ``n`` tokens at positions ``start …`` of a model shaped as ``cfg``. ``types``: the tensors'
    storage types (:func:`file_types` of a model's file; :func:`q2_types` by default); ``ctx``: the session's
    context (default ``start + n``), ``chunk`` its prefill chunk (default ``n``): they size the reference path's
    KV arrays, which its activation peak scores whole."""
    ctx = start + n if ctx is None else ctx
    _check(cfg, start, n, ctx, chunk=n if chunk is None else chunk, kv_bytes_per_value=kv_bytes_per_value,
           activation_itemsize=activation_itemsize)
    types = q2_types(cfg) if types is None else types
    E, H, D, V, F = cfg.n_embd, cfg.n_head, cfg.head_dim, cfg.n_vocab, cfg.ff_exp
    hc, k, end = cfg.n_hc, cfg.n_expert_used, start + n
    flops, wflops = dict.fromkeys(PARTS, 0), dict.fromkeys(PARTS, 0)

    def add(part, f, weights=False):
        flops[part] += 2 * f  # f multiply-adds
        if weights:
            wflops[part] += 2 * f

    kv_written = kv_read = 0
    raw_overwritten = n - (min(cfg.swa, end) - min(cfg.swa, start))  # per layer, once the window is full
    raw_keys = _sum_visible(start, n, lambda q: min(cfg.swa, q + 1))  # every layer's window
    for il in range(cfg.n_layer):
        R = cfg.ratio(il)
        add("attention projections", n * (E * cfg.q_lora + cfg.q_lora * cfg.q_dim + E * D + cfg.q_dim * cfg.o_lora
                                         + cfg.o_groups * cfg.o_lora * E), weights=True)
        add("hyper-connections", 2 * n * cfg.hc_dim * cfg.mix_hc, weights=True)  # the two mixers' linears
        add("hyper-connections", 2 * n * (hc * E + hc * hc * E + hc * E))  # collapse, combine, post
        keys = raw_keys
        kv_written += n * D
        kv_read += min(cfg.swa - 1, start) * D + n * D  # the window before the chunk, and the chunk's own rows
        if R:
            W = cfg.compressor_width(il, D)
            rows = end // R - start // R  # rows the chunk completes
            add("compressors", 2 * n * E * W, weights=True)
            add("compressors", rows * coff(R) * R * D)
            kv_written += rows * D
            kv_read += (end // R) * D
            selects = cfg.has_indexer(il) and end // R > cfg.idx_topk
            top = cfg.idx_topk if cfg.has_indexer(il) else None
            keys += _sum_visible(start, n, lambda q: (q + 1) // R if top is None else min((q + 1) // R, top))
            if cfg.has_indexer(il):
                WI = cfg.compressor_width(il, cfg.idx_dim)
                add("compressors", 2 * n * E * WI, weights=True)
                add("compressors", rows * coff(R) * R * cfg.idx_dim)
                kv_written += rows * cfg.idx_dim
                if selects:
                    add("indexer", n * (cfg.q_lora * cfg.idx_heads * cfg.idx_dim + E * cfg.idx_heads), weights=True)
                    seen = _sum_visible(start, n, lambda q: (q + 1) // R)
                    add("indexer", seen * cfg.idx_heads * (cfg.idx_dim + 1))  # dots, then the head weighting
                    kv_read += (end // R) * cfg.idx_dim
        add("attention", 2 * keys * H * D)  # scores, then weighted values
        add("routed experts", n * E * cfg.n_expert + n * k * 3 * E * F, weights=True)
        add("shared expert", n * 3 * E * F, weights=True)
    add("output head", cfg.hc_dim * hc + E * V, weights=True)
    add("output head", hc * E)

    nbytes = weight_nbytes(cfg, types)
    experts_read = min(n * k, cfg.n_expert)
    weight_bytes = 0
    for name, b in nbytes.items():
        if name.endswith(EXPERT_SUFFIXES):
            weight_bytes += b // cfg.n_expert * experts_read
        elif name.endswith(PER_TOKEN_ROWS):
            weight_bytes += b // V * n  # a row per vocabulary entry
        else:
            weight_bytes += b
    chunk = n if chunk is None else chunk
    return ChunkCost(start, n, flops, wflops, weight_bytes, kv_read * kv_bytes_per_value,
                     kv_written * kv_bytes_per_value,
                     (kv_written - cfg.n_layer * raw_overwritten * D) * kv_bytes_per_value,
                     activation_bytes(cfg, n, ctx, chunk, activation_itemsize))


def activation_bytes(cfg: ModelConfig, n: int, ctx: int, chunk: int, itemsize: int = ACTIVATION_ITEMSIZE) -> int:
    """Peak activation memory of a chunk of ``n`` tokens on ds4lab's reference formulas (the numpy backend, and
    the GPU backends with their attention kernels off), in a session of ``ctx`` tokens and prefill ``chunk``:

    - the hidden state in and out (``n × n_hc × n_embd`` each);
    - the largest transient: the attention's scores (the reference scores every slot of the raw ring and of the
      layer's compressed rows, and holds three ``[n, n_head, keys]`` arrays at once: the scores, their shifted
      copy and its exponential) or the indexer's (``[n, idx_heads, rows]``, three likewise);
    - the new KV state, which the reference builds whole beside the old one (states are immutable values).

    ds4's kernels make no score tensor and write the state in place; their peak is the hidden states and the
    chunk's projections."""
    _check(cfg, 0, n, ctx, chunk=chunk, itemsize=itemsize)
    raw_cap = graph_caps(cfg, ctx, chunk)[0]
    widest = state = 0
    for il in range(cfg.n_layer):
        R, rows = cfg.ratio(il), layer_comp_cap(cfg, il, ctx)
        widest = max(widest, cfg.n_head * (raw_cap + rows))
        state += raw_cap * cfg.head_dim
        if R:
            state += rows * cfg.head_dim + 2 * coff(R) * R * cfg.compressor_width(il, cfg.head_dim)
        if cfg.has_indexer(il):
            widest = max(widest, cfg.idx_heads * rows)
            state += rows * cfg.idx_dim + 2 * coff(R) * R * cfg.compressor_width(il, cfg.idx_dim)
    return itemsize * (n * (2 * cfg.hc_dim + 3 * widest) + state)


# -- a prefill, decode, and the Flash table ----------------------------------------------------------------------
def prefill_costs(cfg: ModelConfig, n_tokens: int, chunk: int, types: dict[str, Q] | None = None,
                  ctx: int | None = None, **kw) -> list[ChunkCost]:
    """:func:`chunk_cost` of every chunk of a prefill of ``n_tokens`` tokens from position 0 in chunks of
    ``chunk`` (ending on multiples of it, as a session schedules them)."""
    if chunk < 1 or n_tokens < 1:
        raise ValueError(f"a prefill needs a positive chunk and tokens, got chunk {chunk}, {n_tokens} tokens")
    ctx = n_tokens if ctx is None else ctx
    return [chunk_cost(cfg, s, min(chunk, n_tokens - s), types, ctx, chunk, **kw)
            for s in range(0, n_tokens, chunk)]


def cost_row(label: str, c: ChunkCost) -> dict:
    """A table row of ``c``: FLOPs per part and in all, bytes, and per token."""
    return dict(step=label, start=c.start, tokens=c.tokens, **{f"{p} GFLOP": c.flops[p] / 1e9 for p in PARTS},
                GFLOP=c.total_flops / 1e9, GFLOP_per_token=c.total_flops / c.tokens / 1e9,
                weights_GiB=c.weight_bytes / 2**30, kv_read_MiB=c.kv_bytes_read / 2**20,
                kv_written_MiB=c.kv_bytes_written / 2**20, flop_per_byte=c.intensity)


def flash_table(cfg: ModelConfig | None = None, chunk: int = 2048, position: int = 32768) -> list[dict]:
    """The real Flash config's costs (q2 types): a prefill chunk of ``chunk`` tokens starting at ``position`` and
    one decode step at ``position + chunk``, as rows of :func:`cost_row`."""
    from .config import FLASH

    cfg = FLASH if cfg is None else cfg
    ctx = position + chunk + 1
    return [cost_row(f"prefill chunk of {chunk}", chunk_cost(cfg, position, chunk, ctx=ctx, chunk=chunk)),
            cost_row("decode step", chunk_cost(cfg, position + chunk, 1, ctx=ctx, chunk=chunk))]
