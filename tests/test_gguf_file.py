"""GGUF reading, writing and checking (ds4lab.gguf_file) and random test models (ds4lab.testing)."""

import io
import math
import mmap
import re
import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from ds4lab import config, gguf_file, testing
from ds4lab.config import ModelFileError
from ds4lab.gguf_file import GGUFModelFile, load_model_file, tensor_byte_shape, write_gguf
from ds4lab.quants import dequantize
from ds4lab.testing import make_model
from ds4lab.tokenizer import BOS, EOS

SMALL_METADATA = {
    "general.architecture": ("deepseek4", "STRING"),
    "general.name": ("small", "STRING"),
    "t.u8": (200, "UINT8"),
    "t.i8": (-5, "INT8"),
    "t.u16": (60000, "UINT16"),
    "t.i16": (-30000, "INT16"),
    "t.u32": (4_000_000_000, "UINT32"),
    "t.i32": (-7, "INT32"),
    "t.u64": (2**40, "UINT64"),
    "t.i64": (-(2**40), "INT64"),
    "t.f32": (1e-6, "FLOAT32"),
    "t.f64": (0.1, "FLOAT64"),
    "t.bool": (False, "BOOL"),
    "t.str": ("héllo ｜ wörld", "STRING"),
    "t.u32s": ([0, 0, 4, 128], "ARRAY[UINT32]"),
    "t.i32s": ([-1, 2], "ARRAY[INT32]"),
    "t.f32s": ([10.0, 0.1, -2.5], "ARRAY[FLOAT32]"),
    "t.strs": (["a", "b c", "<｜User｜>"], "ARRAY[STRING]"),
}
SMALL_SHAPES = [
    ("f32.weight", (8,), Q.F32),
    ("f16.weight", (16, 3), Q.F16),
    ("bf16.weight", (8, 2), Q.BF16),
    ("q8_0.weight", (64, 2), Q.Q8_0),
    ("q2_k.weight", (256, 2), Q.Q2_K),
    ("q4_k.weight", (256, 1, 2), Q.Q4_K),
    ("iq2_xxs.weight", (256, 3, 2), Q.IQ2_XXS),
    ("i32.weight", (2, 5), Q.I32),
]


def small_tensors(seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [(name, shape, qtype, rng.integers(0, 256, math.prod(tensor_byte_shape(shape, qtype)), dtype=np.uint8))
            for name, shape, qtype in SMALL_SHAPES]


def write_small(path: Path, tensors: list | None = None) -> Path:
    return write_gguf(path, SMALL_METADATA, small_tensors() if tensors is None else tensors)


@pytest.fixture(scope="module")
def nano_path(tmp_path_factory) -> Path:
    return make_model(config.NANO, tmp_path_factory.mktemp("nano") / "nano.gguf", seed=3)


def raises_for(path: Path, *parts: str):
    """Expect a ModelFileError whose message starts with the path and contains every regex in ``parts``."""
    return pytest.raises(ModelFileError, match="(?s)^" + re.escape(str(path)) + "".join(f"(?=.*{p})" for p in parts))


def rewrite(src: Path, dst: Path, *, drop: tuple = (), meta: dict | None = None, tensors: dict | None = None) -> Path:
    """Copy a GGUF through open + write_gguf, dropping or replacing metadata keys and tensors."""
    f = GGUFModelFile.open(src)
    metadata = {k: v for k, v in f.metadata.items() if k not in drop} | (meta or {})
    entries = [(n, t.shape, t.qtype, t.data) for n, t in f.tensors.items() if n not in drop]
    entries = [(tensors or {}).get(e[0], e) for e in entries]
    return write_gguf(dst, metadata, entries)


# -- round trips -------------------------------------------------------------------------------------


def test_small_file_round_trip(tmp_path):
    tensors = small_tensors()
    f = GGUFModelFile.open(write_small(tmp_path / "small.gguf", tensors))
    assert f.metadata == SMALL_METADATA
    assert list(f.tensors) == [name for name, *_ in tensors]
    for name, shape, qtype, raw in tensors:
        t = f.tensors[name]
        assert (t.name, t.shape, t.qtype) == (name, shape, qtype)
        assert t.data.dtype == np.uint8 and t.data.shape == tensor_byte_shape(shape, qtype)
        assert t.nbytes == raw.size and t.data.tobytes() == raw.tobytes()
    assert f.alignment == 32 and f.file_size == (tmp_path / "small.gguf").stat().st_size


def test_data_shape_rule():
    assert tensor_byte_shape((8,), Q.F32) == (32,)
    assert tensor_byte_shape((4096, 129280), Q.F16) == (129280, 8192)
    assert tensor_byte_shape((4096, 2048, 256), Q.IQ2_XXS) == (256, 2048, 16 * 66)
    assert tensor_byte_shape((6, 129280), Q.I32) == (129280, 24)


def test_custom_alignment_round_trip(tmp_path):
    meta = SMALL_METADATA | {"general.alignment": (64, "UINT32")}
    f = GGUFModelFile.open(write_gguf(tmp_path / "a.gguf", meta, small_tensors()))
    assert f.alignment == 64 and f.metadata == meta
    assert all(t.data.ctypes.data % 64 == (f.tensors["f32.weight"].data.ctypes.data % 64) for t in f.tensors.values())


def test_nano_loads_as_nano(nano_path):
    cfg, f = load_model_file(nano_path)
    assert cfg == config.NANO
    specs = cfg.tensor_specs()
    assert set(f.tensors) == {n for n, (_, _, required) in specs.items() if required} | {
        "blk.3.exp_probs_b.bias", "blk.5.exp_probs_b.bias"}
    assert all(t.shape == specs[n][0] for n, t in f.tensors.items())
    types = {n: f.tensors[n].qtype for n in (
        "token_embd.weight", "output.weight", "output_norm.weight", "blk.2.indexer.proj.weight",
        "blk.0.ffn_gate_tid2eid.weight", "blk.4.ffn_up_exps.weight", "blk.4.ffn_down_exps.weight")}
    assert types == {"token_embd.weight": Q.F16, "output.weight": Q.Q8_0, "output_norm.weight": Q.F32,
                     "blk.2.indexer.proj.weight": Q.F16, "blk.0.ffn_gate_tid2eid.weight": Q.I32,
                     "blk.4.ffn_up_exps.weight": Q.IQ2_XXS, "blk.4.ffn_down_exps.weight": Q.Q2_K}


def test_rewriting_an_opened_file_reproduces_it(nano_path, tmp_path):
    copy = rewrite(nano_path, tmp_path / "copy.gguf")
    assert copy.read_bytes() == nano_path.read_bytes()


def test_tensor_data_is_a_view_of_the_mapped_file(nano_path):
    _, f = load_model_file(nano_path)
    t = f.tensors["blk.1.ffn_gate_exps.weight"]
    assert t.data.shape == (8, 256, 66) and not t.data.flags.owndata and not t.data.flags.writeable
    base = t.data
    while not isinstance(base, mmap.mmap):
        assert base is not None, "TensorInfo.data does not lead back to the file mapping"
        base = base.obj if isinstance(base, memoryview) else base.base


# -- refused files -----------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    with raises_for(tmp_path / "nope.gguf", "no such file"):
        GGUFModelFile.open(tmp_path / "nope.gguf")


@pytest.mark.parametrize("content, message", [
    (b"", "empty file"),
    (b"GGML" + bytes(60), "not a GGUF file"),
    (b"GG", "not a GGUF file"),
    (b"GGUF\x03\x00\x00\x00", "truncated GGUF header"),
    (b"GGUF" + struct.pack("<IQQ", 3, 2**40, 2**50) + bytes(100), "more than 124 bytes can hold"),
])
def test_refused_headers(tmp_path, content, message):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with raises_for(path, message):
        GGUFModelFile.open(path)


def test_version_2_is_refused(tmp_path):
    path = write_small(tmp_path / "v2.gguf")
    blob = bytearray(path.read_bytes())
    blob[4:8] = struct.pack("<I", 2)
    path.write_bytes(blob)
    with raises_for(path, "version 2"):
        GGUFModelFile.open(path)


@pytest.mark.parametrize("seed", range(8))
def test_garbage_after_a_valid_header(tmp_path, seed):
    rng = np.random.default_rng(seed)
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 3, 5) + rng.integers(0, 256, 4000, dtype=np.uint8).tobytes())
    with raises_for(path, "metadata key #0", "(needs [0-9]+ bytes at offset 32|holds a string of [0-9]+ bytes)"):
        GGUFModelFile.open(path)


def test_corrupted_bytes_never_escape_as_raw_errors(tmp_path):
    good = write_small(tmp_path / "good.gguf").read_bytes()
    rng = np.random.default_rng(0)
    path = tmp_path / "corrupt.gguf"
    for _ in range(200):
        blob = bytearray(good)
        for at in rng.integers(4, 900, size=3):  # header, metadata and tensor directory
            blob[at] = rng.integers(0, 256)
        path.write_bytes(blob)
        try:
            GGUFModelFile.open(path)
        except ModelFileError as e:
            assert str(e).startswith(str(path))


def test_truncated_tensor_data(nano_path, tmp_path):
    path = tmp_path / "cut.gguf"
    path.write_bytes(nano_path.read_bytes()[:-1000])
    with raises_for(path, "truncated", r"blk\.5\.ffn_down_shexp\.weight"):
        GGUFModelFile.open(path)


def test_a_tensor_offset_past_any_file_is_a_damaged_directory(nano_path, tmp_path):
    """An offset (or dims) past any real file said "the file is truncated", which no longer file mends."""
    data = bytearray(nano_path.read_bytes())
    at = data.index(b"token_embd.weight") + len(b"token_embd.weight")
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<Q", data, at + 4 + 8 * n_dims + 4, 1 << 55)
    path = tmp_path / "far.gguf"
    path.write_bytes(data)
    with raises_for(path, r"token_embd\.weight", f"its offset {1 << 55} ask for more than a pebibyte: the tensor "
                    "directory is damaged"):
        GGUFModelFile.open(path)


@pytest.mark.parametrize("keep, message", [
    (30, "more than 30 bytes can hold"),  # the counts are intact but nothing else is
    (5000, r"tokenizer\.ggml\.tokens claims 1024 STRING elements"),  # inside the tokenizer strings
    (40000, r"token_embd\.weight.*truncated"),  # inside the first tensor
])
def test_truncated_header(nano_path, tmp_path, keep, message):
    path = tmp_path / "cut.gguf"
    path.write_bytes(nano_path.read_bytes()[:keep])
    with raises_for(path, message):
        GGUFModelFile.open(path)


def patch_entry(path: Path, name: str, *, ne0: int | None = None, type_id: int | None = None) -> None:
    """Edit a tensor's directory entry in place (name, n_dims u32, dims u64..., type u32, offset u64)."""
    blob = bytearray(path.read_bytes())
    at = blob.index(name.encode()) + len(name)
    n_dims = struct.unpack_from("<I", blob, at)[0]
    if ne0 is not None:
        struct.pack_into("<Q", blob, at + 4, ne0)
    if type_id is not None:
        struct.pack_into("<I", blob, at + 4 + 8 * n_dims, type_id)
    path.write_bytes(blob)


def test_unknown_type_id(tmp_path):
    path = write_small(tmp_path / "t.gguf")
    patch_entry(path, "q8_0.weight", type_id=99)
    with raises_for(path, r"q8_0\.weight", "unknown GGML type id 99"):
        GGUFModelFile.open(path)


def test_unsupported_type(tmp_path):
    path = write_gguf(tmp_path / "t.gguf", SMALL_METADATA, [("q4_0.weight", (32, 2), Q.Q4_0, np.zeros(36, np.uint8))])
    with raises_for(path, r"q4_0\.weight", "Q4_0"):
        GGUFModelFile.open(path)


def test_row_not_a_whole_number_of_blocks(tmp_path):
    path = write_small(tmp_path / "t.gguf")
    patch_entry(path, "q8_0.weight", ne0=65)
    with raises_for(path, r"q8_0\.weight", "block size"):
        GGUFModelFile.open(path)


def test_size_that_disagrees_with_the_next_tensor(tmp_path):
    path = write_small(tmp_path / "t.gguf")
    patch_entry(path, "f32.weight", ne0=16)  # 64 bytes, but f16.weight starts 32 bytes later
    with raises_for(path, r"f32\.weight", r"f16\.weight"):
        GGUFModelFile.open(path)


# -- load_model_file checks --------------------------------------------------------------------------


def test_missing_metadata_key(nano_path, tmp_path):
    path = rewrite(nano_path, tmp_path / "m.gguf", drop=("deepseek4.expert_count",))
    with raises_for(path, r"deepseek4\.expert_count"):
        load_model_file(path)


def test_wrong_tensor_shape(nano_path, tmp_path):
    bad = ("blk.1.attn_sinks.weight", (5,), Q.F32, np.zeros(20, np.uint8))
    path = rewrite(nano_path, tmp_path / "m.gguf", tensors={bad[0]: bad})
    with raises_for(path, r"blk\.1\.attn_sinks\.weight", r"\(5,\)", r"\(4,\)"):
        load_model_file(path)


def test_missing_tensor(nano_path, tmp_path):
    path = rewrite(nano_path, tmp_path / "m.gguf", drop=("blk.2.indexer_compressor_kv.weight",))
    with raises_for(path, r"blk\.2\.indexer_compressor_kv\.weight", "missing"):
        load_model_file(path)


def test_token_count_must_equal_vocab_size(nano_path, tmp_path):
    tokens, type_name = GGUFModelFile.open(nano_path).metadata["tokenizer.ggml.tokens"]
    path = rewrite(nano_path, tmp_path / "m.gguf", meta={"tokenizer.ggml.tokens": (tokens[:-1], type_name)})
    with raises_for(path, r"tokenizer\.ggml\.tokens", "1023", "1024"):
        load_model_file(path)


def test_merges_are_required(nano_path, tmp_path):
    path = rewrite(nano_path, tmp_path / "m.gguf", drop=("tokenizer.ggml.merges",))
    with raises_for(path, r"tokenizer\.ggml\.merges", "missing"):
        load_model_file(path)


# -- atomic writes -----------------------------------------------------------------------------------


def test_failed_write_leaves_nothing(tmp_path):
    with pytest.raises(ValueError, match=r"x\.weight.*31 bytes"):
        write_gguf(tmp_path / "m.gguf", SMALL_METADATA, [("x.weight", (8,), "F32", np.zeros(31, np.uint8))])
    assert list(tmp_path.iterdir()) == []


def test_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"old")

    def disk_full(self, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(gguf_file.GGUFWriter, "write_ti_data_to_file", disk_full)
    with pytest.raises(OSError, match="disk full"):
        write_small(path)
    assert list(tmp_path.iterdir()) == [path] and path.read_bytes() == b"old"


def test_bad_metadata_type_name(tmp_path):
    with pytest.raises(ValueError, match=r"t\.x.*'ARRAY'"):
        write_gguf(tmp_path / "m.gguf", SMALL_METADATA | {"t.x": ([1], "ARRAY")}, [])
    assert list(tmp_path.iterdir()) == []


# -- make_model --------------------------------------------------------------------------------------


def test_make_model_is_deterministic(nano_path, tmp_path):
    again = make_model(config.NANO, tmp_path / "again.gguf", seed=3)
    other = make_model(config.NANO, tmp_path / "other.gguf", seed=4)
    assert again.read_bytes() == nano_path.read_bytes()
    assert other.read_bytes() != nano_path.read_bytes()


def test_make_model_types_and_router_bias(tmp_path):
    path = make_model(config.NANO, tmp_path / "m.gguf", dense_type="F16", expert_types=("Q8_0", "F32"),
                      router_bias_layers=(0, 4))
    cfg, f = load_model_file(path)
    assert cfg == config.NANO
    assert f.tensors["blk.3.attn_q_b.weight"].qtype == Q.F16 and f.tensors["output.weight"].qtype == Q.F16
    assert f.tensors["blk.3.ffn_gate_exps.weight"].qtype == Q.Q8_0
    assert f.tensors["blk.3.ffn_down_exps.weight"].qtype == Q.F32
    assert sorted(n for n in f.tensors if n.endswith("exp_probs_b.bias")) == [
        "blk.0.exp_probs_b.bias", "blk.4.exp_probs_b.bias"]


def test_make_model_refuses_partial_blocks(tmp_path):
    cfg = config.replace(config.NANO, ff_exp=128)  # Q2_K down projection rows of 128
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_down_exps\.weight.*Q2_K"):
        make_model(cfg, tmp_path / "m.gguf")
    assert list(tmp_path.iterdir()) == []


def test_hash_routing_table(nano_path):
    cfg, f = load_model_file(nano_path)
    for il in range(cfg.n_hash_layer):
        ids = f.tensors[f"blk.{il}.ffn_gate_tid2eid.weight"].data.view("<i4")
        assert ids.shape == (cfg.n_vocab, cfg.n_expert_used)
        assert ids.min() >= 0 and ids.max() < cfg.n_expert
        assert all(len(set(row)) == cfg.n_expert_used for row in ids.tolist())
        assert len(np.unique(ids[:, 0])) == cfg.n_expert  # ids are spread over all experts


@pytest.mark.parametrize("name, mean, std", [
    ("token_embd.weight", 0.0, 1.0),
    ("output.weight", 0.0, 1 / 16),
    ("blk.2.attn_q_b.weight", 0.0, 1 / math.sqrt(128)),
    ("blk.4.ffn_gate_exps.weight", 0.0, 1 / 16),
    ("blk.4.ffn_down_exps.weight", 0.0, 1 / 16),
    ("blk.1.hc_attn_fn.weight", 0.0, 0.5 / 32),
    ("blk.3.attn_compressor_kv.weight", 0.0, 1 / 16),
    ("blk.3.ffn_norm.weight", 1.0, 0.1),
])
def test_weight_scales(nano_path, name, mean, std):
    t = GGUFModelFile.open(nano_path).tensors[name]
    x = dequantize(np.asarray(t.data), t.qtype, t.shape[0])
    assert abs(x.mean() - mean) < 0.05 * std + 4 * std / math.sqrt(x.size)
    assert abs(x.std() - std) < 0.05 * std + 4 * std / math.sqrt(2 * x.size)


def test_tokenizer_metadata(nano_path):
    meta = GGUFModelFile.open(nano_path).metadata
    tokens = meta["tokenizer.ggml.tokens"][0]
    assert meta["tokenizer.ggml.model"] == ("gpt2", "STRING")
    assert len(tokens) == 1024 and len(meta["tokenizer.ggml.merges"][0]) == 1024 - 256 - 7
    assert tokens[meta["tokenizer.ggml.bos_token_id"][0]] == BOS
    assert tokens[meta["tokenizer.ggml.eos_token_id"][0]] == EOS


def test_builtin_text_when_the_data_directory_is_absent(tmp_path, monkeypatch):
    monkeypatch.setattr(testing, "_DATA_DIR", tmp_path / "absent")
    testing.default_tokenizer_text.cache_clear()
    try:
        assert testing.default_tokenizer_text() == testing._FALLBACK_TEXT
        cfg, _ = load_model_file(make_model(config.NANO, tmp_path / "m.gguf"))
        assert cfg == config.NANO
    finally:
        testing.default_tokenizer_text.cache_clear()


# -- hostile files: every count bounded, every value checked, the data section tiled --------------------


def key_entry_at(blob: bytes, key: str) -> int:
    """Offset just past a metadata key's name (where its u32 value type starts)."""
    return blob.index(struct.pack("<Q", len(key)) + key.encode()) + 8 + len(key)


@pytest.mark.parametrize("count", [2**31, 2**40, 2**63, 2**64 - 1])
def test_an_array_length_past_the_file_is_refused_at_once(nano_path, tmp_path, count):
    """A damaged u64 length once made the reader loop for ever, growing ~15 MB/s."""
    blob = bytearray(nano_path.read_bytes())
    at = key_entry_at(blob, "deepseek4.attention.compress_ratios")  # type ARRAY, elem UINT32, then the count
    struct.pack_into("<Q", blob, at + 8, count)
    path = tmp_path / "long.gguf"
    path.write_bytes(blob)
    with raises_for(path, r"deepseek4\.attention\.compress_ratios", f"claims {count} UINT32 elements"):
        GGUFModelFile.open(path)


def test_an_array_of_arrays_is_refused(nano_path, tmp_path):
    blob = bytearray(nano_path.read_bytes())
    at = key_entry_at(blob, "deepseek4.attention.compress_ratios")
    struct.pack_into("<I", blob, at + 4, 9)  # element type ARRAY
    path = tmp_path / "nested.gguf"
    path.write_bytes(blob)
    with raises_for(path, r"deepseek4\.attention\.compress_ratios", "array of arrays"):
        GGUFModelFile.open(path)


def test_a_type_shrunk_in_the_directory_leaves_a_gap_and_is_refused(tmp_path):
    """F32 → F16 halves a tensor's bytes: the next tensor no longer starts where this one ends."""
    tensors = [("big.weight", (4096,), Q.F32, np.zeros(16384, np.uint8)), *small_tensors()]
    path = write_small(tmp_path / "t.gguf", tensors)
    patch_entry(path, "big.weight", type_id=int(Q.F16))
    with raises_for(path, r"f32\.weight", r"big\.weight", "disagrees"):
        GGUFModelFile.open(path)


def test_the_last_tensor_shrunk_or_data_appended_is_refused(tmp_path):
    path = write_small(tmp_path / "t.gguf")
    with path.open("ab") as f:
        f.write(bytes(4096))
    with raises_for(path, "4096 bytes follow the last tensor"):
        GGUFModelFile.open(path)


def test_a_sparse_file_of_zeros_after_the_header_is_refused(nano_path, tmp_path):
    """nano's first 64 KiB, then zeros to 8 GiB, once loaded with all-zero logits."""
    path = tmp_path / "big.gguf"
    with path.open("wb") as f:
        f.write(nano_path.read_bytes()[:65536])
        f.truncate(8 << 30)
    with raises_for(path, "bytes follow the last tensor"):
        GGUFModelFile.open(path)


@pytest.mark.parametrize("key, value", [
    ("deepseek4.rope.freq_base", float("nan")), ("deepseek4.rope.freq_base", 0.0),
    ("deepseek4.attention.layer_norm_rms_epsilon", -1e-6), ("deepseek4.attention.layer_norm_rms_epsilon", 0.0),
    ("deepseek4.hyper_connection.epsilon", float("inf")), ("deepseek4.expert_weights_scale", 0.0),
    ("deepseek4.rope.scaling.yarn_beta_fast", float("nan")), ("deepseek4.rope.scaling.yarn_beta_slow", -1.0),
    ("deepseek4.attention.compress_rope_freq_base", float("-inf")), ("deepseek4.rope.scaling.factor", 0.0),
])
def test_float_keys_out_of_range_are_refused(nano_path, tmp_path, key, value):
    path = rewrite(nano_path, tmp_path / "m.gguf", meta={key: (value, "FLOAT32")})
    with raises_for(path, re.escape(key), "expected a finite value"):
        load_model_file(path)


@pytest.mark.parametrize("clamp", [float("nan"), 0.0, -10.0, float("inf")])
def test_swiglu_clamps_out_of_range_are_refused(nano_path, tmp_path, clamp):
    path = rewrite(nano_path, tmp_path / "m.gguf",
                   meta={"deepseek4.swiglu_clamp_exp": ([10.0, 10.0, clamp, 10.0, 10.0, 10.0], "ARRAY[FLOAT32]")})
    with raises_for(path, r"swiglu_clamp_exp", "layer 2"):
        load_model_file(path)


def test_sinkhorn_iterations_are_bounded(nano_path, tmp_path):
    key = "deepseek4.hyper_connection.sinkhorn_iterations"
    path = rewrite(nano_path, tmp_path / "m.gguf", meta={key: (2**31, "UINT32")})
    with raises_for(path, r"sinkhorn_iterations", "2147483648"):
        load_model_file(path)


def test_a_tensor_the_metadata_has_no_use_for_is_refused(nano_path, tmp_path):
    """hash_layer_count lowered from 3 to 2 leaves blk.2's hash table unread."""
    path = rewrite(nano_path, tmp_path / "m.gguf", meta={"deepseek4.hash_layer_count": (2, "UINT32")})
    with raises_for(path, r"blk\.2\.ffn_gate_tid2eid\.weight", "not part of"):
        load_model_file(path)


def test_ds4s_mtp_support_file_is_named(nano_path, tmp_path):
    """ds4's MTP/DSpark support GGUF (its mtp.N.* tensors, no layers of its own) is named as the add-on it is, not
    reported as a model missing its tensors; `inspect` says the same."""
    f = GGUFModelFile.open(nano_path)
    norm = f.tensors["output_norm.weight"]
    entries = [("mtp.0.e_proj.weight", (256, 256), Q.F16, np.zeros((256, 512), np.uint8)),
               ("mtp.0.enorm.weight", norm.shape, norm.qtype, norm.data)]
    path = write_gguf(tmp_path / "DeepSeek-V4-Flash-DSpark-support.gguf", f.metadata, entries)
    with raises_for(path, "MTP/DSpark support file", "not a model of its own"):
        load_model_file(path)
    assert "MTP/DSpark support file" in GGUFModelFile.open(path).print_summary(io.StringIO())


@pytest.mark.skipif(not Path("/dev/null").exists(), reason="needs /dev/null")
def test_write_gguf_refuses_to_replace_what_is_not_a_regular_file(tmp_path):
    for target in (Path("/dev/null"), tmp_path):
        with pytest.raises(ValueError, match="not a regular file"):
            write_small(target)
    assert Path("/dev/null").is_char_device() and list(tmp_path.iterdir()) == []


def test_holes_read_as_zeros_and_cost_no_disk(tmp_path):
    shapes = [("a.weight", (1 << 20,), Q.F32), ("b.weight", (8,), Q.F32), ("c.weight", (1 << 20,), Q.F16)]
    b = np.arange(8, dtype="<f4").view(np.uint8)
    path = write_gguf(tmp_path / "sparse.gguf", SMALL_METADATA,
                      [(n, s, q, b if n == "b.weight" else None) for n, s, q in shapes])
    f = GGUFModelFile.open(path)
    assert not f.tensors["a.weight"].data.any() and not f.tensors["c.weight"].data.any()
    assert f.tensors["b.weight"].data.tobytes() == b.tobytes()
    assert path.stat().st_size > 6 << 20 and path.stat().st_blocks * 512 < 1 << 20


def test_the_fingerprint_tells_models_of_one_configuration_apart(nano_path, tmp_path):
    other = make_model(config.NANO, tmp_path / "other.gguf", seed=4)
    copy = rewrite(nano_path, tmp_path / "copy.gguf")
    one = rewrite(nano_path, tmp_path / "one.gguf", tensors={"blk.5.ffn_norm.weight": (
        "blk.5.ffn_norm.weight", (256,), Q.F32, np.ones(256, "<f4").view(np.uint8))})
    prints = [GGUFModelFile.open(p).fingerprint for p in (nano_path, copy, other, one)]
    assert prints[0] == prints[1] and len(set(prints)) == 3 and len(prints[0]) == 32


def test_a_vocabulary_without_a_special_token_names_the_file(nano_path, tmp_path):
    tokens, type_name = GGUFModelFile.open(nano_path).metadata["tokenizer.ggml.tokens"]
    renamed = [t if t != BOS else "not-bos" for t in tokens]
    path = rewrite(nano_path, tmp_path / "m.gguf", meta={"tokenizer.ggml.tokens": (renamed, type_name)})
    import ds4lab

    with raises_for(path, "tokenizer"):
        ds4lab.load(path, backend="numpy")


def test_a_failed_data_write_names_the_file(tmp_path, monkeypatch):
    """numpy's tofile on a full disk says only "34816 requested and 576 written"."""
    def full(*args):
        raise OSError("34816 requested and 576 written")

    monkeypatch.setattr(gguf_file, "_write_tensor_data", full)
    with pytest.raises(OSError, match=f"writing {re.escape(str(tmp_path / 'm.gguf'))}: 34816 requested"):
        write_small(tmp_path / "m.gguf")
    assert list(tmp_path.iterdir()) == []


def test_a_huge_array_count_within_the_file_is_refused_quickly(nano_path, tmp_path):
    """A count that the bytes left could hold (the tensor data read as elements) but that no ds4 key has; zeros
    of a sparse file would otherwise read as billions of empty strings."""
    import time

    blob = bytearray(nano_path.read_bytes())
    at = key_entry_at(blob, "deepseek4.swiglu_clamp_exp")
    struct.pack_into("<Q", blob, at + 8, 4_200_000)
    path = tmp_path / "long.gguf"
    path.write_bytes(blob + bytes(17_000_000))
    began = time.perf_counter()
    with raises_for(path, r"swiglu_clamp_exp", "claims 4200000 FLOAT32 elements", "at most"):
        GGUFModelFile.open(path)
    assert time.perf_counter() - began < 2


def test_a_float_key_whose_type_id_became_an_integer_is_refused(nano_path, tmp_path):
    """FLOAT32 → INT32 in the type id reads the same 4 bytes as 1176256512 for a base of 10000."""
    blob = bytearray(nano_path.read_bytes())
    at = key_entry_at(blob, "deepseek4.rope.freq_base")
    struct.pack_into("<I", blob, at, 5)  # INT32
    path = tmp_path / "retyped.gguf"
    path.write_bytes(blob)
    with raises_for(path, r"deepseek4\.rope\.freq_base", "1176256512"):
        load_model_file(path)


def test_a_string_length_past_the_cap_is_refused_before_reading(tmp_path):
    """Zeros of a sparse file are valid UTF-8: a damaged key length of 256 MiB once read (and tripled) it all."""
    path = write_small(tmp_path / "s.gguf")
    blob = bytearray(path.read_bytes())
    struct.pack_into("<Q", blob, 24, 256 << 20)  # the first key's length
    path.write_bytes(bytes(blob))
    with path.open("r+b") as f:
        f.truncate(300 << 20)
    with raises_for(path, "metadata key #0", "string of 268435456 bytes"):
        GGUFModelFile.open(path)


def test_a_refused_file_leaves_no_mapping_behind(tmp_path):
    path = write_small(tmp_path / "t.gguf")
    patch_entry(path, "q8_0.weight", type_id=99)
    with pytest.raises(ModelFileError) as e:
        GGUFModelFile.open(path)
    assert e.value.__context__ is None and e.value.__cause__ is None


def test_write_gguf_through_a_symlink_replaces_its_file_and_keeps_the_link(tmp_path):
    """make-model -o link.gguf put a regular file where the link was and left the file it named as it was."""
    real = write_small(tmp_path / "real.gguf", [])
    link = tmp_path / "link.gguf"
    link.symlink_to("real.gguf")
    assert write_small(link) == link
    assert link.is_symlink() and GGUFModelFile.open(real).tensors.keys() == {n for n, *_ in small_tensors()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.gguf", "real.gguf"]
