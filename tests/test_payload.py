"""The ds4 session payload, DSV4 version 1 (docs/FORMATS.md, "The DSV4 session payload"; ds4.c:15736-16660).

Shapes, sizes and byte layouts are written out here from that section, independently of ds4lab.kv.payload.
"""

import dataclasses
import struct
import tracemalloc

import numpy as np
import pytest

from ds4lab.config import FLASH, NANO, replace
from ds4lab.kv.layout import graph_caps
from ds4lab.kv.payload import (
    LayerPayload,
    Payload,
    PayloadError,
    decode_payload,
    encode_payload,
    parse_layout,
    payload_nbytes,
    with_version,
)

MAGIC = 0x34565344
CUSTOM = replace(NANO, n_layer=4, compress_ratios=(4, 128, 0, 4), swiglu_clamp=(10.0,) * 4)


# -- helpers (from docs/FORMATS.md, not from the module) --------------------------------------------

def spec_caps(cfg, ctx, prefill_cap):
    """(raw_cap, raw_window, comp_cap) of a graph session (docs/FORMATS.md, "The DSV4 session payload")."""
    window = min(cfg.swa, ctx)
    wanted = min(window + prefill_cap, ctx)
    raw_cap = min(max(min(-(-wanted // 256) * 256, 8192), window), ctx)
    return raw_cap, window, ctx // 4 + 2


def random_payload(cfg, T, ctx=4096, prefill_cap=2048, seed: int | None = 0):
    """A payload of the right shapes: seeded random rows and tokens, or zeros and 0, 1, 2, … with no seed."""
    rng = None if seed is None else np.random.default_rng(seed)

    def f32(*shape):
        return rng.standard_normal(shape, dtype=np.float32) if rng is not None else np.zeros(shape, np.float32)

    raw_cap, window, comp_cap = spec_caps(cfg, ctx, prefill_cap)
    layers = []
    for il in range(cfg.n_layer):
        R = cfg.compress_ratios[il]
        st = LayerPayload(raw=f32(min(T, window), cfg.head_dim))
        if R:
            coff = 2 if R == 4 else 1
            st.comp = f32(T // R, cfg.head_dim)
            st.comp_state_kv = f32(coff * R, coff * cfg.head_dim)
            st.comp_state_score = f32(coff * R, coff * cfg.head_dim)
        if R == 4:
            st.index = f32(T // 4, cfg.idx_dim)
            st.index_state_kv = f32(8, 2 * cfg.idx_dim)
            st.index_state_score = f32(8, 2 * cfg.idx_dim)
        layers.append(st)
    tokens = (rng.integers(0, cfg.n_vocab, T, dtype=np.uint32) if rng is not None
              else np.arange(T, dtype=np.uint32) % cfg.n_vocab)
    return Payload(ctx=ctx, prefill_cap=prefill_cap, raw_cap=raw_cap, raw_window=window, comp_cap=comp_cap,
                   tokens=tokens, logits=f32(cfg.n_vocab), layers=layers)


def assert_same(a: Payload, b: Payload):
    for f in ("ctx", "prefill_cap", "raw_cap", "raw_window", "comp_cap"):
        assert getattr(a, f) == getattr(b, f), f
    assert a.tokens.dtype == np.uint32 and np.array_equal(a.tokens, b.tokens)
    assert a.logits.dtype == np.float32 and np.array_equal(a.logits, b.logits)
    assert len(a.layers) == len(b.layers)
    for il, (x, y) in enumerate(zip(a.layers, b.layers)):
        for f in ("raw", "comp", "comp_state_kv", "comp_state_score", "index", "index_state_kv", "index_state_score"):
            u, v = getattr(x, f), getattr(y, f)
            assert (u is None) == (v is None), (il, f)
            if u is not None:
                assert u.dtype == np.float32 and u.shape == v.shape and np.array_equal(u, v), (il, f)


def header(data):
    return list(struct.unpack_from("<13I", data, 0))


def patch_u32(data, index, value):
    out = bytearray(data)
    struct.pack_into("<I", out, 4 * index, value)
    return bytes(out)


# -- sizes ------------------------------------------------------------------------------------------

def spec_flash_bytes(T):
    """The size that docs/FORMATS.md, "The DSV4 session payload", gives, written out."""
    r = min(T, 128)
    return (52 + 4 * T + 4 * 129280 + 2 * 43 * 4
            + 43 * r * 2048
            + 21 * ((T // 4) * (2048 + 512) + 2 * 32768 + 2 * 8192)
            + 20 * ((T // 128) * 2048 + 2 * 262144))


def test_flash_sizes_from_config_without_allocating():
    tracemalloc.start()
    try:
        assert payload_nbytes(FLASH, 2048) == 52_184_460
        assert payload_nbytes(FLASH, 65536) == 926_033_292
        for T in (128, 256, 1024, 4096, 32768, 100_096, 1_048_448):
            assert payload_nbytes(FLASH, T) == 23_995_788 + 13_764 * T == spec_flash_bytes(T), T
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


@pytest.mark.parametrize("T", [0, 1, 3, 5, 7, 50, 101, 127, 129, 130, 1000, 2047])
def test_flash_sizes_general_formula(T):
    assert payload_nbytes(FLASH, T) == spec_flash_bytes(T)


def test_sizes_raw_window_and_raw_cap():
    # a session with ctx < swa has raw_window = ctx; raw_cap below the window caps raw_live too
    base = payload_nbytes(FLASH, 50, raw_window=128)
    assert payload_nbytes(FLASH, 50, raw_window=40) == base - 43 * 10 * 2048
    assert payload_nbytes(FLASH, 50, raw_window=128, raw_cap=30) == base - 43 * 20 * 2048
    # NANO: layers 0,1 ratio 0; 2,4 ratio 4; 3,5 ratio 128; window 32; head 128, indexer 128, vocab 1024
    T = 263
    want = (52 + 4 * T + 4 * 1024 + 2 * 6 * 4 + 6 * 32 * 512
            + 2 * ((T // 4) * (512 + 512) + 2 * 8 * 256 * 4 + 2 * 8 * 256 * 4)
            + 2 * ((T // 128) * 512 + 2 * 128 * 128 * 4))
    assert payload_nbytes(NANO, T) == want


# -- round trips ------------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg,T,ctx", [
    (NANO, 0, 4096), (NANO, 1, 4096), (NANO, 13, 4096), (NANO, 70, 4096), (NANO, 263, 4096),
    (NANO, 13, 20), (NANO, 19, 20), (CUSTOM, 5, 4096), (CUSTOM, 131, 4096), (CUSTOM, 300, 512),
])
def test_round_trip(cfg, T, ctx):
    p = random_payload(cfg, T, ctx=ctx, prefill_cap=2048, seed=T)
    data = encode_payload(p, cfg)
    assert isinstance(data, bytes)
    assert len(data) == payload_nbytes(cfg, T, raw_window=min(cfg.swa, ctx))
    q = decode_payload(data, cfg, ctx=ctx, prefill_cap=2048)
    assert_same(p, q)
    assert encode_payload(q, cfg) == data
    # any byte buffer works, and the result does not alias it
    buf = bytearray(data)
    q2 = decode_payload(memoryview(buf), cfg, ctx=ctx, prefill_cap=2048)
    buf[-4:] = b"\xff\xff\xff\xff"
    assert_same(p, q2)


def test_flash_round_trip_small_t():
    p = random_payload(FLASH, 6, ctx=65536)
    data = encode_payload(p, FLASH)
    assert len(data) == payload_nbytes(FLASH, 6) == spec_flash_bytes(6)
    assert header(data) == [MAGIC, 2, 65536, 2048, 2304, 128, 16386, 6, 43, 512, 128, 129280, 6]
    assert_same(p, decode_payload(data, FLASH, ctx=65536, prefill_cap=2048))


@pytest.mark.parametrize("cfg,ctx,prefill_cap", [
    (FLASH, 65536, 2048), (FLASH, 1048576, 8192), (FLASH, 2048, 2048), (FLASH, 100, 2048), (FLASH, 300, 16),
    (NANO, 4096, 2048), (NANO, 20, 2048), (NANO, 4096, 1),
])
def test_graph_caps(cfg, ctx, prefill_cap):
    assert graph_caps(cfg, ctx, prefill_cap) == spec_caps(cfg, ctx, prefill_cap)
    assert graph_caps(FLASH, 65536, 2048) == (2304, 128, 16386)


def test_smaller_saved_context_loads():
    p = random_payload(NANO, 70, ctx=4096)
    q = decode_payload(encode_payload(p, NANO), NANO, ctx=8192, prefill_cap=2048)
    assert q.ctx == 4096 and q.comp_cap == 4096 // 4 + 2
    assert_same(p, q)


# -- byte layout ------------------------------------------------------------------------------------

def test_header_and_token_bytes():
    p = random_payload(NANO, 70)
    data = encode_payload(p, NANO)
    raw_cap, window, comp_cap = spec_caps(NANO, 4096, 2048)
    assert (raw_cap, window, comp_cap) == (2304, 32, 1026)
    assert header(data) == [MAGIC, 2, 4096, 2048, 2304, 32, 1026, 70, 6, 128, 128, 1024, 32]
    assert data[:4] == b"DSV4"
    assert list(struct.unpack_from("<70I", data, 52)) == p.tokens.tolist()
    off = 52 + 4 * 70
    assert np.array_equal(np.frombuffer(data, "<f4", 1024, off), p.logits)
    off += 4 * 1024
    assert list(struct.unpack_from("<12I", data, off)) == [0, 0, 17, 0, 17, 0, 0, 0, 17, 0, 17, 0]
    off += 48
    assert np.array_equal(np.frombuffer(data, "<f4", 32 * 128, off).reshape(32, 128), p.layers[0].raw)


@pytest.mark.parametrize("version", [1, 2])
def test_hand_built_ratio0_payload(version):
    """ds4's two payload versions: the same bytes but the version field."""
    cfg = replace(NANO, n_layer=1, compress_ratios=(0,), swiglu_clamp=(10.0,), n_hash_layer=1, n_vocab=8)
    raw = np.arange(3 * 128, dtype=np.float32).reshape(3, 128) / 7
    logits = np.linspace(-1, 1, 8, dtype=np.float32)
    p = Payload(ctx=16, prefill_cap=4, raw_cap=16, raw_window=16, comp_cap=3,
                tokens=np.array([5, 0, 7], dtype=np.uint32), logits=logits, layers=[LayerPayload(raw=raw)],
                version=version)
    want = (struct.pack("<13I", MAGIC, version, 16, 4, 16, 16, 3, 3, 1, 128, 128, 8, 3)
            + struct.pack("<3I", 5, 0, 7)
            + struct.pack("<8f", *logits.tolist())
            + struct.pack("<I", 0) + struct.pack("<I", 0)
            + struct.pack(f"<{3 * 128}f", *raw.ravel().tolist()))
    assert encode_payload(p, cfg) == want
    assert len(want) == payload_nbytes(cfg, 3)
    assert_same(decode_payload(want, cfg, ctx=16, prefill_cap=4), p)


def test_hand_built_compressed_layers_order():
    """Ratio 4 then ratio 128: every field filled with its own constant, assembled in the order of
    docs/FORMATS.md, "The DSV4 session payload"."""
    cfg = replace(NANO, n_layer=2, compress_ratios=(4, 128), swiglu_clamp=(10.0,) * 2, n_hash_layer=0, n_vocab=4)
    T, hd, ix = 9, 128, 128
    shapes = [
        [("raw", (9, hd)), ("comp", (2, hd)), ("comp_state_kv", (8, 2 * hd)), ("comp_state_score", (8, 2 * hd)),
         ("index", (2, ix)), ("index_state_kv", (8, 2 * ix)), ("index_state_score", (8, 2 * ix))],
        [("raw", (9, hd)), ("comp", (0, hd)), ("comp_state_kv", (128, hd)), ("comp_state_score", (128, hd))],
    ]
    layers, body = [], b""
    for il, fields in enumerate(shapes):
        st = LayerPayload(raw=None)
        for k, (name, shape) in enumerate(fields):
            value = 10.0 * il + k + 0.5
            setattr(st, name, np.full(shape, value, dtype=np.float32))
            n = shape[0] * shape[1]
            body += struct.pack(f"<{n}f", *([value] * n))
        layers.append(st)
    p = Payload(ctx=64, prefill_cap=16, raw_cap=64, raw_window=32, comp_cap=18,
                tokens=np.arange(T, dtype=np.uint32) % 4, logits=np.ones(4, np.float32), layers=layers)  # ids < vocab
    want = (struct.pack("<13I", MAGIC, 2, 64, 16, 64, 32, 18, T, 2, hd, ix, 4, 9)
            + struct.pack(f"<{T}I", *(t % 4 for t in range(T))) + struct.pack("<4f", 1, 1, 1, 1)
            + struct.pack("<2I", 2, 0) + struct.pack("<2I", 2, 0) + body)
    assert encode_payload(p, cfg) == want
    assert_same(decode_payload(want, cfg, ctx=64, prefill_cap=16), p)


# -- loader validation ------------------------------------------------------------------------------

T0 = 40  # NANO, ctx 4096, prefill 2048: raw_live 32, 10 ratio-4 rows, 0 ratio-128 rows


@pytest.fixture(scope="module")
def good():
    return encode_payload(random_payload(NANO, T0), NANO)


def load(data, ctx=4096, prefill_cap=2048):
    return decode_payload(data, NANO, ctx=ctx, prefill_cap=prefill_cap)


def expect(data, *parts, **kw):
    with pytest.raises(PayloadError) as ei:
        load(data, **kw)
    msg = str(ei.value)
    for part in parts:
        assert part in msg, msg
    return ei.value


def test_wrong_magic(good):
    e = expect(patch_u32(good, 0, 0x34565345), "unsupported session payload version", "magic is 0x34565345",
               "expected 0x34565344")
    assert isinstance(e, ValueError) and e.field == "magic"


def test_versions_1_and_2_load_the_same_and_others_are_refused(good):
    """ds4 wrote version 1 until e8e8779b (2026-05-26), 2 since: the same bytes for a DeepSeek V4 model."""
    old = with_version(good, 1)
    assert old[4:8] == struct.pack("<I", 1) and old[8:] == good[8:] and header(good)[1] == 2
    assert_same(load(old), dataclasses.replace(load(good), version=1))
    expect(patch_u32(good, 1, 3), "unsupported session payload version (a newer ds4's", "version is 3, expected 1 (")
    expect(patch_u32(good, 1, 0), "unsupported session payload version", "version is 0, expected 1 (")
    with pytest.raises(PayloadError, match="version is 1, expected 2 \\(what the KVC header"):
        parse_layout(old, NANO, version=2)
    with pytest.raises(ValueError, match="payload version 3 is not one ds4 reads"):
        with_version(good, 3)


def test_tokens_not_below_context(good):
    expect(patch_u32(good, 7, 4096), "does not fit current context", "n_tokens is 4096",
           "less than the current context 4096")
    # a session whose context equals T cannot take it either (saved ctx is checked first)
    expect(patch_u32(good, 2, 40), "does not fit current context", "n_tokens is 40", ctx=40)


def test_saved_context_larger_than_current(good):
    expect(good, "does not fit current context", "ctx is 4096", "larger than the current context 2048", ctx=2048)


def test_a_payload_of_another_chunk_loads(good):
    """ds4 has not compared prefill_cap since bb543791: the raw rows are stored in position order."""
    assert_same(load(good, prefill_cap=512), load(good))


def test_raw_window_mismatch():
    data = encode_payload(random_payload(NANO, 13, ctx=20), NANO)
    expect(data, "graph chunk layout does not match", "raw_window is 20, expected 32")


@pytest.mark.parametrize("index,field,value,want", [
    (8, "n_layer", 43, 6), (9, "head_dim", 512, 128), (10, "indexer_head_dim", 64, 128), (11, "vocab", 129280, 1024),
])
def test_dim_mismatch(good, index, field, value, want):
    expect(patch_u32(good, index, value), "written for a different DS4 layout", f"{field} is {value}, expected {want}")


def test_raw_ring_layout(good):
    expect(patch_u32(good, 12, 31), "raw ring layout does not match", "raw_live is 31",
           "32 = min(n_tokens 40, raw_window 32)")
    expect(patch_u32(good, 4, 0), "raw ring layout does not match", "raw_cap is 0")
    expect(patch_u32(good, 4, 16), "raw ring layout does not match", "raw_live is 32, larger than raw_cap 16")


def test_comp_cap_too_large(good):
    expect(patch_u32(good, 6, 1027), "compressed cache is larger than current context", "comp_cap is 1027",
           "larger than the current capacity 1026")


HDR, TOK, LOG, CNT = 52, 52 + 4 * T0, 52 + 4 * T0 + 4 * 1024, 52 + 4 * T0 + 4 * 1024 + 48
RAW = 32 * 128 * 4
R4 = RAW + 10 * 512 + 2 * 8 * 256 * 4 + 10 * 512 + 2 * 8 * 256 * 4  # a whole ratio-4 layer


@pytest.mark.parametrize("cut,field", [
    (0, "header"), (3, "header"), (51, "header"),
    (HDR, "tokens"), (HDR + 7, "tokens"), (TOK - 1, "tokens"),
    (TOK, "logits"), (TOK + 2000, "logits"),
    (LOG, "layer 0 compressed row count"), (LOG + 27, "layer 0 indexer row count"),
    (CNT, "layer 0 raw"), (CNT + RAW - 4, "layer 0 raw"), (CNT + 2 * RAW, "layer 2 raw"),
    (CNT + 3 * RAW, "layer 2 comp"), (CNT + 3 * RAW + 10 * 512 + 5, "layer 2 comp_state_kv"),
    (CNT + 2 * RAW + R4 - 1, "layer 2 index_state_score"), (CNT + 2 * RAW + R4 + RAW, "layer 3 comp_state_kv"),
    (-1, "layer 5 comp_state_score"),
])
def test_truncated(good, cut, field):
    e = expect(good[:cut], "truncated session payload", f"{field} needs")
    assert e.field == field


def test_trailing_byte(good):
    expect(good + b"\0", "trailing payload bytes", f"1 bytes after offset {len(good)}")


def test_row_count_inconsistent_with_tokens(good):
    # four more tokens in the header and the body: T = 44 implies 11 ratio-4 rows, the file has 10
    data = patch_u32(good, 7, 44)
    data = data[:TOK] + struct.pack("<4I", 1, 2, 3, 4) + data[TOK:]
    expect(data, "invalid compressed row count", "layer 2 compressed row count is 10",
           "expected 11 = floor(n_tokens 44 / ratio 4)")
    # one extra row on layer 2 (count and row both present)
    data = patch_u32(good, (LOG + 2 * 4) // 4, 11)
    data = data[:CNT + 3 * RAW] + bytes(512) + data[CNT + 3 * RAW:]
    expect(data, "invalid compressed row count", "layer 2 compressed row count is 11", "expected 10")


def test_row_count_beyond_capacity(good):
    expect(patch_u32(good, (LOG + 2 * 4) // 4, 1027), "invalid compressed row count",
           "layer 2 compressed row count is 1027, larger than capacity 1026")
    # ratio-0 layers hold no compressed rows at all (graph layer_comp_cap = 0)
    expect(patch_u32(good, LOG // 4, 1), "layer 0 compressed row count is 1, larger than capacity 0")
    # ratio-128 layers have capacity for indexer counts in ds4, but no indexer rows
    expect(patch_u32(good, (LOG + 24 + 3 * 4) // 4, 1), "invalid indexer row count",
           "layer 3 indexer row count is 1", "no indexer rows on a ratio-128 layer")


# -- writer validation ------------------------------------------------------------------------------

def test_encode_validates_shapes():
    p = random_payload(CUSTOM, 20)
    p.layers[3].index = p.layers[3].index[:4]
    with pytest.raises(ValueError, match=r"layer 3 \(ratio 4\) index has shape \(4, 128\), expected \(5, 128\)"):
        encode_payload(p, CUSTOM)
    p = random_payload(CUSTOM, 20)
    p.layers[1].comp_state_kv = np.zeros((8, 256), np.float32)
    with pytest.raises(ValueError,
                       match=r"layer 1 \(ratio 128\) comp_state_kv has shape \(8, 256\), expected \(128, 128\)"):
        encode_payload(p, CUSTOM)
    p = random_payload(CUSTOM, 20)
    p.layers[2].comp = np.zeros((5, 128), np.float32)
    with pytest.raises(ValueError, match=r"layer 2 \(ratio 0\) comp must be None"):
        encode_payload(p, CUSTOM)
    p = random_payload(CUSTOM, 20)
    p.layers[0].index_state_score = None
    with pytest.raises(ValueError, match=r"layer 0 \(ratio 4\) index_state_score is missing"):
        encode_payload(p, CUSTOM)
    p = random_payload(CUSTOM, 20)
    p.layers[0].raw = p.layers[0].raw[1:]
    with pytest.raises(ValueError, match=r"layer 0 \(ratio 4\) raw has shape \(19, 128\), expected \(20, 128\)"):
        encode_payload(p, CUSTOM)
    p = random_payload(CUSTOM, 20)
    with pytest.raises(ValueError, match="payload has 4 layers, config has n_layer=6"):
        encode_payload(p, NANO)
    p.logits = p.logits[:10]
    with pytest.raises(ValueError, match=r"logits has shape \(10,\), expected \(1024,\)"):
        encode_payload(p, CUSTOM)
