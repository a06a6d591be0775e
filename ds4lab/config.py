"""Model configuration, read from GGUF metadata (docs/FORMATS.md, "GGUF model files").

Every dimension comes from the ``deepseek4.*`` keys, so the real 284B Flash file and tiny models of the
same architecture go through the same code. ``validate_tensors`` checks a tensor directory against the
configuration (the same section's tensor table) and names the file and tensor on any mismatch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as Q

from .text_table import runs

ARCH = "deepseek4"


def is_int(x) -> bool:
    """A whole number as a count, index or position takes it: a Python or NumPy integer, not a bool or a float."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def check_count(value, name: str, least: int = 1, of: str | None = None) -> int:
    """``value`` as an int, refused by ``name`` unless a whole number (``of``: of what) of at least ``least``."""
    if not is_int(value) or value < least:
        what = "a whole number" + (f" of {of}" if of else "")
        raise ValueError(f"{name} must be {what}, at least {least}, got {value!r}")
    return int(value)


class ModelFileError(ValueError):
    """A model file that cannot be used; the message names the file and the key or tensor."""


# (field, key, kind); kind is "u32" (strict UINT32 as ds4 requires), "float", "bool",
# "u32list"/"floatlist" (arrays with one entry per layer), "ctx" (u32 or u64).
_KEYS = [
    ("n_layer", "block_count", "u32"),
    ("n_embd", "embedding_length", "u32"),
    ("n_vocab", "vocab_size", "u32"),
    ("n_head", "attention.head_count", "u32"),
    ("n_head_kv", "attention.head_count_kv", "u32"),
    ("head_dim", "attention.key_length", "u32"),
    ("value_dim", "attention.value_length", "u32"),
    ("n_rot", "rope.dimension_count", "u32"),
    ("q_lora", "attention.q_lora_rank", "u32"),
    ("o_lora", "attention.output_lora_rank", "u32"),
    ("o_groups", "attention.output_group_count", "u32"),
    ("n_expert", "expert_count", "u32"),
    ("n_expert_used", "expert_used_count", "u32"),
    ("ff_exp", "expert_feed_forward_length", "u32"),
    ("n_expert_shared", "expert_shared_count", "u32"),
    ("n_hash_layer", "hash_layer_count", "u32"),
    ("swa", "attention.sliding_window", "u32"),
    ("idx_heads", "attention.indexer.head_count", "u32"),
    ("idx_dim", "attention.indexer.key_length", "u32"),
    ("idx_topk", "attention.indexer.top_k", "u32"),
    ("n_hc", "hyper_connection.count", "u32"),
    ("sinkhorn_iters", "hyper_connection.sinkhorn_iterations", "u32"),
    ("compress_ratios", "attention.compress_ratios", "u32list"),
    ("swiglu_clamp", "swiglu_clamp_exp", "floatlist"),
    ("rope_freq_base", "rope.freq_base", "float"),
    ("compress_rope_freq_base", "attention.compress_rope_freq_base", "float"),
    ("expert_weight_scale", "expert_weights_scale", "float"),
    ("rms_eps", "attention.layer_norm_rms_epsilon", "float"),
    ("expert_weights_norm", "expert_weights_norm", "bool"),
]
# Optional keys with their defaults (ds4 reads the group counts and, since its DeepSeek V4 Pro support, the RoPE
# scaling keys optionally, with these defaults; the HC eps it now requires, ds4lab still defaults to Flash's value;
# docs/FORMATS.md, "GGUF model files").
_OPTIONAL = [
    ("rope_orig_ctx", "rope.scaling.original_context_length", "ctx", 65536),
    ("rope_scale_factor", "rope.scaling.factor", "float", 16.0),
    ("yarn_beta_fast", "rope.scaling.yarn_beta_fast", "float", 32.0),
    ("yarn_beta_slow", "rope.scaling.yarn_beta_slow", "float", 1.0),
    ("expert_group_count", "expert_group_count", "u32", 0),
    ("expert_group_used", "expert_group_used_count", "u32", 0),
    ("hc_eps", "hyper_connection.epsilon", "float", 1e-6),
    ("context_length", "context_length", "ctx", 0),
]


# Open ranges of the float keys: outside them a model computes NaN, Inf or nonsense without an error. Float
# keys may be stored as integers (as ds4 accepts): the bits of a float32 of 1e-6 or more read as an integer
# are at least 8.9e8, so the bounds below also refuse a FLOAT32 key whose type id was damaged into an integer.
_FLOAT_RANGES = [
    ("rope_freq_base", "rope.freq_base", (1.0, 1e8)),
    ("compress_rope_freq_base", "attention.compress_rope_freq_base", (1.0, 1e8)),
    ("rope_scale_factor", "rope.scaling.factor", (0.0, 1e6)),
    ("yarn_beta_fast", "rope.scaling.yarn_beta_fast", (0.0, 1e6)),
    ("yarn_beta_slow", "rope.scaling.yarn_beta_slow", (0.0, 1e6)),
    ("expert_weight_scale", "expert_weights_scale", (0.0, 1e6)),
    ("rms_eps", "attention.layer_norm_rms_epsilon", (0.0, 1.0)),
    ("hc_eps", "hyper_connection.epsilon", (0.0, 1.0)),
]
MAX_SINKHORN_ITERS = 1000


@dataclass(frozen=True)
class ModelConfig:
    n_layer: int
    n_embd: int
    n_vocab: int
    n_head: int
    n_head_kv: int
    head_dim: int
    value_dim: int
    n_rot: int
    q_lora: int
    o_lora: int
    o_groups: int
    n_expert: int
    n_expert_used: int
    ff_exp: int
    n_expert_shared: int
    n_hash_layer: int
    swa: int
    idx_heads: int
    idx_dim: int
    idx_topk: int
    n_hc: int
    sinkhorn_iters: int
    compress_ratios: tuple[int, ...]
    swiglu_clamp: tuple[float, ...]
    rope_orig_ctx: int = 65536
    rope_freq_base: float = 10000.0
    rope_scale_factor: float = 16.0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    compress_rope_freq_base: float = 160000.0
    expert_weight_scale: float = 1.5
    rms_eps: float = 1e-6
    expert_weights_norm: bool = True
    expert_group_count: int = 0
    expert_group_used: int = 0
    hc_eps: float = 1e-6
    context_length: int = 0

    # -- derived ------------------------------------------------------------------------------------
    @property
    def mix_hc(self) -> int:
        return 2 * self.n_hc + self.n_hc * self.n_hc

    @property
    def hc_dim(self) -> int:
        return self.n_hc * self.n_embd

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def heads_per_group(self) -> int:
        return self.n_head // self.o_groups

    def ratio(self, il: int) -> int:
        return self.compress_ratios[il]

    def compressor_width(self, il: int, dim: int) -> int:
        """W = coff·D: ratio-4 compressors project twice as wide (the overlapping halves;
        docs/MODEL.md, "Attention")."""
        return (2 if self.ratio(il) == 4 else 1) * dim

    def check_layer(self, layer, name: str = "layer") -> int:
        """``layer`` as an int, refused by ``name`` unless it is a whole number below ``n_layer``."""
        if not is_int(layer):
            raise TypeError(f"{name} must be a layer number, got {layer!r}")
        if not 0 <= layer < self.n_layer:
            raise ValueError(f"{name} {layer} is not a layer of this model (0…{self.n_layer - 1})")
        return int(layer)

    def has_indexer(self, il: int) -> bool:
        return self.ratio(il) == 4

    def is_hash_layer(self, il: int) -> bool:
        return il < self.n_hash_layer

    # -- metadata -----------------------------------------------------------------------------------
    @classmethod
    def from_metadata(cls, meta: dict, source: str = "<metadata>") -> "ModelConfig":
        """Build a config from a GGUF metadata dict of ``key -> (value, GGUFValueType name)``.

        The type names are those of ``gguf.GGUFValueType`` ("UINT32", "FLOAT32", "ARRAY[UINT32]", ...).
        """
        arch = _get(meta, "general.architecture", source)
        if arch[0] != ARCH:
            raise ModelFileError(f"{source}: general.architecture is {arch[0]!r}, expected {ARCH!r}")
        values = {}
        for field, key, kind in _KEYS:
            values[field] = _convert(_get(meta, f"{ARCH}.{key}", source), kind, f"{ARCH}.{key}", source)
        for field, key, kind, default in _OPTIONAL:
            full = f"{ARCH}.{key}"
            values[field] = _convert(meta[full], kind, full, source) if full in meta else default
        cfg = cls(**values)
        cfg.check(source)
        return cfg

    def to_metadata(self) -> dict:
        """``key -> (value, type name)`` for every key this config is read from (the GGUF writer's input)."""
        out = {"general.architecture": (ARCH, "STRING")}
        kinds = {"u32": "UINT32", "float": "FLOAT32", "bool": "BOOL", "ctx": "UINT32",
                 "u32list": "ARRAY[UINT32]", "floatlist": "ARRAY[FLOAT32]"}
        for field, key, kind in _KEYS:
            out[f"{ARCH}.{key}"] = (getattr(self, field), kinds[kind])
        for field, key, kind, _ in _OPTIONAL:
            out[f"{ARCH}.{key}"] = (getattr(self, field), kinds[kind])
        return out

    def check(self, source: str = "<config>") -> None:
        """Refuse inconsistent dimensions with a message naming the key (the constraints in
        docs/FORMATS.md, "GGUF model files")."""
        def bad(key, msg):
            raise ModelFileError(f"{source}: {ARCH}.{key}: {msg}")

        for field, key, kind in _KEYS + [(f, k, kd) for f, k, kd, _ in _OPTIONAL]:
            v = getattr(self, field)
            if kind == "u32" and field not in ("n_hash_layer", "expert_group_count", "expert_group_used") and v <= 0:
                bad(key, f"must be positive, got {v}")
        for field, key, (low, high) in _FLOAT_RANGES:
            v = getattr(self, field)
            if not (math.isfinite(v) and low < v < high):
                bad(key, f"is {v}, expected a finite value in ({low}, {high})")
        for il, clamp in enumerate(self.swiglu_clamp[: self.n_layer]):
            if not (math.isfinite(clamp) and clamp > 0):
                bad("swiglu_clamp_exp", f"layer {il} has clamp {clamp}, expected a finite positive value")
        if self.sinkhorn_iters > MAX_SINKHORN_ITERS:
            bad("hyper_connection.sinkhorn_iterations",
                f"{self.sinkhorn_iters} is more than {MAX_SINKHORN_ITERS} (ds4 runs 20 per token and layer)")
        if len(self.compress_ratios) < self.n_layer:
            bad("attention.compress_ratios",
                f"has {len(self.compress_ratios)} entries, expected ≥ {self.n_layer} (block_count)")
        if len(self.swiglu_clamp) < self.n_layer:
            bad("swiglu_clamp_exp",
                f"has {len(self.swiglu_clamp)} entries, expected ≥ {self.n_layer} (block_count)")
        for il in range(self.n_layer):
            if self.compress_ratios[il] not in (0, 4, 128):
                bad("attention.compress_ratios",
                    f"layer {il} has ratio {self.compress_ratios[il]}; ds4 layers use 0, 4 or 128")
        if self.n_head_kv != 1:
            bad("attention.head_count_kv", f"DS4 attention has one shared KV head, got {self.n_head_kv}")
        if self.value_dim != self.head_dim:
            bad("attention.value_length",
                f"K and V are the same vector: value_length {self.value_dim} != key_length {self.head_dim}")
        if self.n_rot % 2 or self.n_rot > self.head_dim or (self.head_dim - self.n_rot) % 64:
            bad("rope.dimension_count",
                f"{self.n_rot}: head_dim − n_rot must be a multiple of 64 (FP8 blocks) and n_rot even")
        if self.n_rot > self.idx_dim and any(self.has_indexer(il) for il in range(self.n_layer)):
            bad("attention.indexer.key_length", f"{self.idx_dim} is smaller than the RoPE tail {self.n_rot}")
        if self.idx_dim % 32 or self.idx_dim & (self.idx_dim - 1):
            bad("attention.indexer.key_length",
                f"{self.idx_dim} must be a power of two and a multiple of 32 (Hadamard, FP4 blocks)")
        if self.n_head % self.o_groups:
            bad("attention.output_group_count", f"{self.o_groups} does not divide head_count {self.n_head}")
        if self.n_expert_used > self.n_expert:
            bad("expert_used_count", f"{self.n_expert_used} > expert_count {self.n_expert}")
        if self.n_expert_shared != 1:
            bad("expert_shared_count", f"DS4 has exactly one shared expert, got {self.n_expert_shared}")
        if self.n_hash_layer > self.n_layer:
            bad("hash_layer_count", f"{self.n_hash_layer} > block_count {self.n_layer}")
        if self.expert_group_count or self.expert_group_used:
            bad("expert_group_count", "group-limited routing is not part of DS4 (must be 0)")

    # -- tensors ------------------------------------------------------------------------------------
    def tensor_specs(self) -> dict[str, tuple[tuple[int, ...], frozenset, bool]]:
        """``name -> (ne shape, allowed GGML types, required)`` for every tensor of the model
        (docs/FORMATS.md, "GGUF model files").

        Dense projections may be stored in any type the loader reads (the real Flash files use the
        types that section names); routed experts accept the K-/IQ-quants and MXFP4 (DeepSeek's own format), plus
        F32/F16/Q8_0 for tiny models whose rows are not multiples of 256.
        """
        E, V, H, HD = self.n_embd, self.n_vocab, self.n_head, self.head_dim
        dense = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q8_0})
        f32 = frozenset({Q.F32})
        half = frozenset({Q.F16, Q.F32, Q.BF16})
        experts = frozenset({Q.IQ2_XXS, Q.Q2_K, Q.Q4_K, Q.MXFP4, Q.F32, Q.F16, Q.Q8_0})
        s = {
            "token_embd.weight": ((E, V), half, True),
            "output_hc_base.weight": ((self.n_hc,), f32, True),
            "output_hc_fn.weight": ((self.hc_dim, self.n_hc), half, True),
            "output_hc_scale.weight": ((1,), f32, True),
            "output_norm.weight": ((E,), f32, True),
            "output.weight": ((E, V), dense, True),
        }
        for il in range(self.n_layer):
            p = f"blk.{il}."
            R = self.ratio(il)
            for sub in ("attn", "ffn"):
                s[p + f"hc_{sub}_fn.weight"] = ((self.hc_dim, self.mix_hc), half, True)
                s[p + f"hc_{sub}_scale.weight"] = ((3,), f32, True)
                s[p + f"hc_{sub}_base.weight"] = ((self.mix_hc,), f32, True)
            s[p + "attn_norm.weight"] = ((E,), f32, True)
            s[p + "attn_q_a.weight"] = ((E, self.q_lora), dense, True)
            s[p + "attn_q_a_norm.weight"] = ((self.q_lora,), f32, True)
            s[p + "attn_q_b.weight"] = ((self.q_lora, self.q_dim), dense, True)
            s[p + "attn_kv.weight"] = ((E, HD), dense, True)
            s[p + "attn_kv_a_norm.weight"] = ((HD,), f32, True)
            s[p + "attn_sinks.weight"] = ((H,), f32, True)
            s[p + "attn_output_a.weight"] = ((self.heads_per_group * HD, self.o_groups * self.o_lora), dense, True)
            s[p + "attn_output_b.weight"] = ((self.o_groups * self.o_lora, E), dense, True)
            if R:
                W = self.compressor_width(il, HD)
                s[p + "attn_compressor_ape.weight"] = ((W, R), half, True)
                s[p + "attn_compressor_kv.weight"] = ((E, W), half, True)
                s[p + "attn_compressor_gate.weight"] = ((E, W), half, True)
                s[p + "attn_compressor_norm.weight"] = ((HD,), f32, True)
            if self.has_indexer(il):
                WI = self.compressor_width(il, self.idx_dim)
                s[p + "indexer.attn_q_b.weight"] = ((self.q_lora, self.idx_heads * self.idx_dim), half, True)
                s[p + "indexer.proj.weight"] = ((E, self.idx_heads), half, True)
                s[p + "indexer_compressor_ape.weight"] = ((WI, R), half, True)
                s[p + "indexer_compressor_kv.weight"] = ((E, WI), half, True)
                s[p + "indexer_compressor_gate.weight"] = ((E, WI), half, True)
                s[p + "indexer_compressor_norm.weight"] = ((self.idx_dim,), f32, True)
            s[p + "ffn_norm.weight"] = ((E,), f32, True)
            s[p + "ffn_gate_inp.weight"] = ((E, self.n_expert), half, True)
            s[p + "exp_probs_b.bias"] = ((self.n_expert,), f32, False)
            if self.is_hash_layer(il):
                s[p + "ffn_gate_tid2eid.weight"] = ((self.n_expert_used, V), frozenset({Q.I32}), True)
            s[p + "ffn_gate_exps.weight"] = ((E, self.ff_exp, self.n_expert), experts, True)
            s[p + "ffn_up_exps.weight"] = ((E, self.ff_exp, self.n_expert), experts, True)
            s[p + "ffn_down_exps.weight"] = ((self.ff_exp, E, self.n_expert), experts, True)
            s[p + "ffn_gate_shexp.weight"] = ((E, self.ff_exp), dense, True)
            s[p + "ffn_up_shexp.weight"] = ((E, self.ff_exp), dense, True)
            s[p + "ffn_down_shexp.weight"] = ((self.ff_exp, E), dense, True)
        return s

    def validate_tensors(self, tensors: dict[str, tuple[tuple[int, ...], Q]], source: str = "<tensors>") -> None:
        """Check ``name -> (ne shape, GGML type)`` against :meth:`tensor_specs`; raise naming the tensor. A tensor
        the configuration has no use for is refused too: it means the metadata and the tensors disagree (a
        ``hash_layer_count`` lowered leaves hash tables no layer reads)."""
        specs = self.tensor_specs()
        held = [il for il in range(self.n_layer) if any(n.startswith(f"blk.{il}.") for n in tensors)]
        if 0 < len(held) < self.n_layer:  # not one tensor of some layers: a file of a model split by layers
            raise ModelFileError(
                f"{source}: holds the tensors of layers {runs(held)} only, of the metadata's {self.n_layer}: one "
                "part of a model split by layers over files (as ds4's two-machine PRO Q4 pair is); ds4lab reads a "
                "model from one file that holds every layer")
        for name in tensors:
            if name not in specs:
                raise ModelFileError(f"{source}: tensor {name} is not part of a ds4 model with this metadata "
                                     f"({self.n_layer} layers, {self.n_hash_layer} hash layers); the metadata and "
                                     f"the tensors disagree")
        for name, (shape, types, required) in specs.items():
            if name not in tensors:
                if required:
                    raise ModelFileError(f"{source}: tensor {name} is missing")
                continue
            got_shape, got_type = tensors[name]
            if tuple(got_shape) != shape:
                raise ModelFileError(
                    f"{source}: tensor {name} has shape {tuple(got_shape)}, expected {shape} from the metadata")
            if got_type not in types:
                allowed = ", ".join(sorted(t.name for t in types))
                raise ModelFileError(f"{source}: tensor {name} has type {Q(got_type).name}, expected one of {allowed}")
        for il in range(self.n_layer):
            g = tensors[f"blk.{il}.ffn_gate_exps.weight"][1]
            u = tensors[f"blk.{il}.ffn_up_exps.weight"][1]
            if g != u:
                raise ModelFileError(f"{source}: tensor blk.{il}.ffn_up_exps.weight has type {Q(u).name} "
                                     f"but gate has {Q(g).name}; they must match")


def _get(meta: dict, key: str, source: str):
    if key not in meta:
        raise ModelFileError(f"{source}: metadata key {key} is missing")
    return meta[key]


def _convert(entry, kind: str, key: str, source: str):
    value, vtype = entry

    def wrong(expected):
        return ModelFileError(f"{source}: metadata key {key} has type {vtype}, expected {expected}")

    if kind == "u32":
        if vtype != "UINT32":
            raise wrong("UINT32")
        return int(value)
    if kind == "ctx":
        if vtype not in ("UINT32", "UINT64"):
            raise wrong("UINT32 or UINT64")
        return int(value)
    if kind == "float":
        if vtype not in ("FLOAT32", "FLOAT64", "UINT32", "INT32"):
            raise wrong("a float (FLOAT32, FLOAT64, UINT32 or INT32)")
        return float(value)
    if kind == "bool":
        if vtype != "BOOL":
            raise wrong("BOOL")
        return bool(value)
    if kind == "u32list":
        if vtype not in ("ARRAY[UINT32]", "ARRAY[INT32]"):
            raise wrong("an array of UINT32 or INT32")
        return tuple(int(v) for v in value)
    if kind == "floatlist":
        if vtype not in ("ARRAY[FLOAT32]", "ARRAY[FLOAT64]"):
            raise wrong("an array of FLOAT32 or FLOAT64")
        return tuple(float(v) for v in value)
    raise AssertionError(kind)


def ds4_ratio(il: int) -> int:
    """ds4's fixed schedule (ds4_layer_compress_ratio): 0,0 then alternating 4 (even) and 128 (odd)."""
    return 0 if il < 2 else (4 if il % 2 == 0 else 128)


FLASH = ModelConfig(
    n_layer=43, n_embd=4096, n_vocab=129280, n_head=64, n_head_kv=1, head_dim=512, value_dim=512,
    n_rot=64, q_lora=1024, o_lora=1024, o_groups=8, n_expert=256, n_expert_used=6, ff_exp=2048,
    n_expert_shared=1, n_hash_layer=3, swa=128, idx_heads=64, idx_dim=128, idx_topk=512, n_hc=4,
    sinkhorn_iters=20, compress_ratios=tuple(ds4_ratio(il) for il in range(43)),
    swiglu_clamp=(10.0,) * 43, context_length=1048576,
)

# The full architecture at a size that runs fast on a 2-core CPU: ratio-4 rows appear every 4 tokens,
# the indexer turns on once more than 16 rows are visible (position 67), ratio-128 rows appear at
# 127 and 255, and the 32-token raw window starts evicting at position 32.
NANO = ModelConfig(
    n_layer=6, n_embd=256, n_vocab=1024, n_head=4, n_head_kv=1, head_dim=128, value_dim=128,
    n_rot=64, q_lora=128, o_lora=128, o_groups=2, n_expert=8, n_expert_used=2, ff_exp=256,
    n_expert_shared=1, n_hash_layer=3, swa=32, idx_heads=4, idx_dim=128, idx_topk=16, n_hc=4,
    sinkhorn_iters=20, compress_ratios=tuple(ds4_ratio(il) for il in range(6)),
    swiglu_clamp=(10.0,) * 6, context_length=4096,
)

PRESETS = {"flash": FLASH, "nano": NANO}


def replace(cfg: ModelConfig, **changes) -> ModelConfig:
    """A copy of ``cfg`` with fields changed; a new ``n_layer`` rebuilds the per-layer lists (ds4's ratio
    schedule, the first clamp) unless they are given too."""
    n = changes.get("n_layer", cfg.n_layer)
    if n != cfg.n_layer:
        changes.setdefault("compress_ratios", tuple(ds4_ratio(il) for il in range(n)))
        changes.setdefault("swiglu_clamp", (cfg.swiglu_clamp[0],) * n)
    out = dataclasses.replace(cfg, **changes)
    out.check()
    return out


# DeepSeek V4 Pro as ds4 runs it since 2026-07 (ds4.c's DS4_SHAPE_PRO): Flash's architecture, wider and deeper, and
# its first two layers ratio 128 where Flash's have none (ds4_expected_layer_compress_ratio).
PRO = replace(FLASH, n_layer=61, n_embd=7168, n_head=128, o_groups=16, q_lora=1536, n_expert=384, ff_exp=3072,
              idx_topk=1024, expert_weight_scale=2.5,
              compress_ratios=(128, 128) + tuple(ds4_ratio(il) for il in range(2, 61)))
# The dims ds4 matches a file's metadata against to tell Flash from Pro (ds4_shape_matches_metadata).
_DS4_SHAPE_FIELDS = ("n_layer", "n_embd", "n_vocab", "n_head", "n_head_kv", "head_dim", "value_dim", "n_rot", "q_lora",
                     "o_lora", "o_groups", "n_expert", "n_expert_used", "ff_exp", "n_expert_shared", "n_hash_layer",
                     "swa", "idx_heads", "idx_dim", "idx_topk", "n_hc", "sinkhorn_iters")


def ds4_model_id(cfg: ModelConfig) -> int:
    """The model id a ds4 KV file of ``cfg``'s model carries (header byte 7): 1 for Pro's shape, else 0 (Flash's id,
    which ds4lab also writes for the smaller models of Flash's architecture)."""
    return 1 if all(getattr(cfg, f) == getattr(PRO, f) for f in _DS4_SHAPE_FIELDS) else 0
