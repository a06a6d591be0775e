"""ModelConfig against the full DeepSeek V4 Flash GGUF contract (docs/FORMATS.md, "GGUF model files").

The metadata and the tensor directory are written out here from that section's tables, independently of
config.FLASH and ModelConfig.tensor_specs, so the test checks the code against the documented contract.
"""

import copy

import pytest
from gguf import GGMLQuantizationType as Q

from ds4lab import config
from ds4lab.config import ModelConfig, ModelFileError

SOURCE = "flash-q2.gguf"

FLASH_METADATA = {
    "general.architecture": ("deepseek4", "STRING"),
    "general.name": ("DeepSeek-V4-Flash", "STRING"),
    "deepseek4.context_length": (1048576, "UINT32"),
    "deepseek4.block_count": (43, "UINT32"),
    "deepseek4.embedding_length": (4096, "UINT32"),
    "deepseek4.vocab_size": (129280, "UINT32"),
    "deepseek4.attention.head_count": (64, "UINT32"),
    "deepseek4.attention.head_count_kv": (1, "UINT32"),
    "deepseek4.attention.key_length": (512, "UINT32"),
    "deepseek4.attention.value_length": (512, "UINT32"),
    "deepseek4.rope.dimension_count": (64, "UINT32"),
    "deepseek4.attention.q_lora_rank": (1024, "UINT32"),
    "deepseek4.attention.output_lora_rank": (1024, "UINT32"),
    "deepseek4.attention.output_group_count": (8, "UINT32"),
    "deepseek4.expert_count": (256, "UINT32"),
    "deepseek4.expert_used_count": (6, "UINT32"),
    "deepseek4.expert_feed_forward_length": (2048, "UINT32"),
    "deepseek4.expert_shared_count": (1, "UINT32"),
    "deepseek4.hash_layer_count": (3, "UINT32"),
    "deepseek4.expert_group_count": (0, "UINT32"),
    "deepseek4.expert_group_used_count": (0, "UINT32"),
    "deepseek4.attention.sliding_window": (128, "UINT32"),
    "deepseek4.attention.indexer.head_count": (64, "UINT32"),
    "deepseek4.attention.indexer.key_length": (128, "UINT32"),
    "deepseek4.attention.indexer.top_k": (512, "UINT32"),
    "deepseek4.hyper_connection.count": (4, "UINT32"),
    "deepseek4.hyper_connection.sinkhorn_iterations": (20, "UINT32"),
    "deepseek4.attention.compress_ratios": ([0, 0] + [4, 128] * 20 + [4], "ARRAY[UINT32]"),
    "deepseek4.swiglu_clamp_exp": ([10.0] * 43, "ARRAY[FLOAT32]"),
    "deepseek4.rope.scaling.original_context_length": (65536, "UINT32"),
    "deepseek4.rope.freq_base": (10000.0, "FLOAT32"),
    "deepseek4.rope.scaling.factor": (16.0, "FLOAT32"),
    "deepseek4.rope.scaling.yarn_beta_fast": (32.0, "FLOAT32"),
    "deepseek4.rope.scaling.yarn_beta_slow": (1.0, "FLOAT32"),
    "deepseek4.attention.compress_rope_freq_base": (160000.0, "FLOAT32"),
    "deepseek4.expert_weights_scale": (1.5, "FLOAT32"),
    "deepseek4.attention.layer_norm_rms_epsilon": (1e-6, "FLOAT32"),
    "deepseek4.hyper_connection.epsilon": (1e-6, "FLOAT32"),
    "deepseek4.expert_weights_norm": (True, "BOOL"),
}

# The tensor table of docs/FORMATS.md, "GGUF model files", as the q2 file has them: (name, type, ne).
GLOBAL_TENSORS = [
    ("token_embd.weight", Q.F16, (4096, 129280)),
    ("output_hc_base.weight", Q.F32, (4,)),
    ("output_hc_fn.weight", Q.F16, (16384, 4)),
    ("output_hc_scale.weight", Q.F32, (1,)),
    ("output_norm.weight", Q.F32, (4096,)),
    ("output.weight", Q.Q8_0, (4096, 129280)),
]
LAYER_TENSORS = [
    ("hc_attn_fn.weight", Q.F16, (16384, 24)),
    ("hc_attn_scale.weight", Q.F32, (3,)),
    ("hc_attn_base.weight", Q.F32, (24,)),
    ("attn_norm.weight", Q.F32, (4096,)),
    ("attn_q_a.weight", Q.Q8_0, (4096, 1024)),
    ("attn_q_a_norm.weight", Q.F32, (1024,)),
    ("attn_q_b.weight", Q.Q8_0, (1024, 32768)),
    ("attn_kv.weight", Q.Q8_0, (4096, 512)),
    ("attn_kv_a_norm.weight", Q.F32, (512,)),
    ("attn_sinks.weight", Q.F32, (64,)),
    ("attn_output_a.weight", Q.Q8_0, (4096, 8192)),
    ("attn_output_b.weight", Q.Q8_0, (8192, 4096)),
    ("hc_ffn_fn.weight", Q.F16, (16384, 24)),
    ("hc_ffn_scale.weight", Q.F32, (3,)),
    ("hc_ffn_base.weight", Q.F32, (24,)),
    ("ffn_norm.weight", Q.F32, (4096,)),
    ("ffn_gate_inp.weight", Q.F16, (4096, 256)),
    ("ffn_gate_exps.weight", Q.IQ2_XXS, (4096, 2048, 256)),
    ("ffn_up_exps.weight", Q.IQ2_XXS, (4096, 2048, 256)),
    ("ffn_down_exps.weight", Q.Q2_K, (2048, 4096, 256)),
    ("ffn_gate_shexp.weight", Q.Q8_0, (4096, 2048)),
    ("ffn_up_shexp.weight", Q.Q8_0, (4096, 2048)),
    ("ffn_down_shexp.weight", Q.Q8_0, (2048, 4096)),
]


def compressor_tensors(ratio: int) -> list:
    """ratio != 0 layers: the KV compressor; ratio-4 layers also the indexer and its compressor."""
    width = (2 if ratio == 4 else 1) * 512
    out = [
        ("attn_compressor_ape.weight", Q.F16, (width, ratio)),
        ("attn_compressor_kv.weight", Q.F16, (4096, width)),
        ("attn_compressor_gate.weight", Q.F16, (4096, width)),
        ("attn_compressor_norm.weight", Q.F32, (512,)),
    ]
    if ratio == 4:
        out += [
            ("indexer.attn_q_b.weight", Q.F16, (1024, 8192)),
            ("indexer.proj.weight", Q.F16, (4096, 64)),
            ("indexer_compressor_ape.weight", Q.F16, (256, 4)),
            ("indexer_compressor_kv.weight", Q.F16, (4096, 256)),
            ("indexer_compressor_gate.weight", Q.F16, (4096, 256)),
            ("indexer_compressor_norm.weight", Q.F32, (128,)),
        ]
    return out


def flash_tensors() -> dict:
    """name -> (ne, type) for the whole Flash q2 file."""
    out = {name: (shape, qtype) for name, qtype, shape in GLOBAL_TENSORS}
    for il in range(43):
        ratio = 0 if il < 2 else (4 if il % 2 == 0 else 128)
        layer = list(LAYER_TENSORS)
        if ratio:
            layer += compressor_tensors(ratio)
        if il < 3:
            layer.append(("ffn_gate_tid2eid.weight", Q.I32, (6, 129280)))
        else:
            layer.append(("exp_probs_b.bias", Q.F32, (256,)))
        for suffix, qtype, shape in layer:
            out[f"blk.{il}.{suffix}"] = (shape, qtype)
    return out


def flash_metadata() -> dict:
    return copy.deepcopy(FLASH_METADATA)


def load(meta: dict) -> ModelConfig:
    return ModelConfig.from_metadata(meta, SOURCE)


def raises(*names: str):
    """Expect a ModelFileError naming the file and every one of ``names``."""
    return pytest.raises(ModelFileError, match="(?s)^" + "".join(f"(?=.*{n})" for n in (SOURCE, *names)))


# -- the full Flash file -----------------------------------------------------------------------------


def test_flash_metadata_gives_the_flash_config():
    cfg = load(flash_metadata())
    assert cfg == config.FLASH
    cfg.validate_tensors(flash_tensors(), SOURCE)


def test_flash_derived_values():
    cfg = load(flash_metadata())
    assert (cfg.mix_hc, cfg.hc_dim, cfg.q_dim, cfg.heads_per_group) == (24, 16384, 32768, 8)
    assert cfg.compress_ratios[:6] == (0, 0, 4, 128, 4, 128) and cfg.compress_ratios[-1] == 4
    assert sum(r == 4 for r in cfg.compress_ratios) == 21
    assert sum(r == 128 for r in cfg.compress_ratios) == 20
    assert [cfg.has_indexer(il) for il in (1, 2, 3, 42)] == [False, True, False, True]
    assert [cfg.is_hash_layer(il) for il in (0, 2, 3)] == [True, True, False]
    assert (cfg.compressor_width(2, cfg.head_dim), cfg.compressor_width(3, cfg.head_dim)) == (1024, 512)
    assert cfg.compressor_width(2, cfg.idx_dim) == 256


def test_to_metadata_matches_the_flash_file():
    meta = config.FLASH.to_metadata()
    for key, (value, type_name) in meta.items():
        expected_value, expected_type = FLASH_METADATA[key]
        assert type_name == expected_type, key
        assert (list(value) if type_name.startswith("ARRAY") else value) == expected_value, key
    assert load(meta) == config.FLASH


# -- metadata errors ---------------------------------------------------------------------------------


def test_missing_key_is_named():
    meta = flash_metadata()
    del meta["deepseek4.expert_count"]
    with raises("deepseek4.expert_count", "missing"):
        load(meta)


def test_integer_key_must_be_uint32():
    meta = flash_metadata()
    meta["deepseek4.attention.head_count"] = (64, "INT32")
    with raises("deepseek4.attention.head_count", "INT32", "UINT32"):
        load(meta)


def test_float_keys_accept_integers_and_ctx_accepts_uint64():
    meta = flash_metadata()
    meta["deepseek4.rope.freq_base"] = (10000, "UINT32")
    meta["deepseek4.rope.scaling.original_context_length"] = (65536, "UINT64")
    assert load(meta) == config.FLASH


def test_ratio_list_too_short():
    meta = flash_metadata()
    meta["deepseek4.attention.compress_ratios"] = ([0, 0] + [4, 128] * 20, "ARRAY[UINT32]")
    with raises("deepseek4.attention.compress_ratios", "42"):
        load(meta)


def test_wrong_architecture():
    meta = flash_metadata()
    meta["general.architecture"] = ("deepseek2", "STRING")
    with raises("general.architecture", "deepseek2"):
        load(meta)


def test_hc_epsilon_is_optional():
    meta = flash_metadata()
    del meta["deepseek4.hyper_connection.epsilon"]
    assert load(meta).hc_eps == 1e-6
    meta["deepseek4.hyper_connection.epsilon"] = (1e-5, "FLOAT32")
    assert load(meta).hc_eps == 1e-5



def test_rope_scaling_keys_are_optional_with_ds4s_defaults():
    # ds4 reads them with model_get_*_compat since it runs DeepSeek V4 Pro: a file without them opens as Flash.
    meta = flash_metadata()
    for key in ("original_context_length", "factor", "yarn_beta_fast", "yarn_beta_slow"):
        del meta[f"deepseek4.rope.scaling.{key}"]
    assert load(meta) == config.FLASH
    meta["deepseek4.rope.scaling.factor"] = (4.0, "FLOAT32")  # present: read, and range-checked
    assert load(meta).rope_scale_factor == 4.0
    meta["deepseek4.rope.scaling.factor"] = (-1.0, "FLOAT32")
    with raises("deepseek4.rope.scaling.factor", "-1"):
        load(meta)


# -- tensor errors -----------------------------------------------------------------------------------


def validate(tensors: dict) -> None:
    config.FLASH.validate_tensors(tensors, SOURCE)


def test_missing_tensor_is_named():
    tensors = flash_tensors()
    del tensors["blk.7.attn_compressor_kv.weight"]
    with raises(r"blk\.7\.attn_compressor_kv\.weight", "missing"):
        validate(tensors)


def test_a_file_of_some_layers_says_it_is_one_part_of_a_split_model():
    """ds4 ships Pro's Q4 model as two files of layers 0-30 and 31-60 (its two-machine split): the first tensor
    found missing was named as if the file were damaged; now the file says which layers it holds."""
    tensors = flash_tensors()
    second_half = {n: t for n, t in tensors.items() if not n.startswith(tuple(f"blk.{il}." for il in range(20)))}
    with raises("holds the tensors of layers 20-42 only, of the metadata's 43", "split by layers"):
        validate(second_half)
    first_half = {n: t for n, t in tensors.items() if not n.startswith(("blk.21.", "blk.42.", "output"))}
    with raises("layers 0-20, 22-41 only"):
        validate(first_half)


def test_wrong_shape_is_named():
    tensors = flash_tensors()
    tensors["blk.4.indexer.proj.weight"] = ((4096, 63), Q.F16)
    with raises(r"blk\.4\.indexer\.proj\.weight", r"\(4096, 63\)", r"\(4096, 64\)"):
        validate(tensors)


def test_wrong_type_is_named():
    tensors = flash_tensors()
    tensors["blk.0.attn_sinks.weight"] = ((64,), Q.F16)
    with raises(r"blk\.0\.attn_sinks\.weight", "F16"):
        validate(tensors)


def test_gate_and_up_types_must_match():
    tensors = flash_tensors()
    tensors["blk.5.ffn_up_exps.weight"] = ((4096, 2048, 256), Q.Q2_K)
    with raises(r"blk\.5\.ffn_up_exps\.weight", "Q2_K", "IQ2_XXS"):
        validate(tensors)


def test_q4_k_experts_are_accepted():
    tensors = flash_tensors()
    for name, (shape, _) in list(tensors.items()):
        if name.endswith("_exps.weight"):
            tensors[name] = (shape, Q.Q4_K)
    validate(tensors)


def test_router_bias_is_optional():
    tensors = {n: t for n, t in flash_tensors().items() if not n.endswith("exp_probs_b.bias")}
    validate(tensors)


# -- replace -----------------------------------------------------------------------------------------


def test_replace_keeps_a_custom_ratio_schedule():
    custom = config.replace(config.NANO, compress_ratios=(0, 4, 4, 128, 0, 4))
    assert config.replace(custom, n_embd=512).compress_ratios == (0, 4, 4, 128, 0, 4)
    assert config.replace(custom, n_layer=4).compress_ratios == (0, 0, 4, 128)
