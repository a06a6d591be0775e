"""The cost model (ds4lab.costs) against independent counts: a tiny config worked by hand, the embedded model's GGUF
tensor sizes, the products the numpy backend's linears compute while it runs, the keys its attention sees, the
rows a session writes and the size of its state, and the memory tracemalloc sees a chunk allocate."""

from __future__ import annotations

import tracemalloc
from dataclasses import replace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import ds4lab
from ds4lab import testing
from ds4lab.backends.numpy_backend import NumpyBackend
from ds4lab.config import FLASH, NANO
from ds4lab.costs import (
    PARTS,
    activation_bytes,
    chunk_cost,
    file_types,
    flash_table,
    prefill_costs,
    q2_types,
    weight_nbytes,
)
from ds4lab.kv.payload import payload_nbytes

# One layer of each kind (raw only, ratio 4 with its indexer, ratio 128), small enough to count by hand.
TINY = replace(NANO, n_layer=3, compress_ratios=(0, 4, 128), swiglu_clamp=(10.0,) * 3, n_embd=8, n_head=2,
               head_dim=4, n_rot=2, q_lora=3, o_lora=2, o_groups=1, n_expert=4, n_expert_used=2, ff_exp=5, swa=4,
               idx_heads=2, idx_dim=2, idx_topk=1, n_hc=2, n_vocab=16)
PROMPT_TOKENS = 320


def test_tiny_config_by_hand():
    """Positions 4-7 of TINY (E 8, H 2, D 4, q_lora 3, o_lora 2, one group, n_hc 2 so mix 8, window 4, top-k 1,
    4 experts of width 5, 2 a token, vocabulary 16). Multiply-adds, then FLOPs = 2 × them."""
    c = chunk_cost(TINY, 4, 4, types=dict.fromkeys(TINY.tensor_specs(), Q.F32), ctx=8)
    # Per token and layer: q_a 8·3 + q_b 3·8 + kv 8·4 + output_a 8·2 + output_b 2·8 = 112; 4 tokens, 3 layers.
    assert c.flops["attention projections"] == 2 * 112 * 4 * 3
    # Ratio 4: kv and gate 2·8·(2·4) a token, one row completed (window 4-7) pooling 2·4 candidates of 4; the
    # indexer's compressor 2·8·(2·2) a token and its row 8 candidates of 2. Ratio 128: kv and gate 2·8·4.
    assert c.flops["compressors"] == 2 * (4 * 2 * 8 * 8 + 8 * 4 + 4 * 2 * 8 * 4 + 8 * 2 + 4 * 2 * 8 * 4)
    # The last query sees 8 // 4 = 2 rows > top-k 1, so the indexer runs: q 3·(2·2) + proj 8·2 a token; the
    # queries see 1, 1, 1, 2 rows: 5 rows × 2 heads × (2 dims + the head weight).
    assert c.flops["indexer"] == 2 * (4 * (12 + 16) + 5 * 2 * 3)
    # Keys: 4 raw keys per query in every layer (window 4); ratio 4 adds min(rows, top-k 1) = 1 each; ratio 128
    # sees no row yet. 52 keys × 2 heads × 4 dims, for the scores and for the values.
    assert c.flops["attention"] == 2 * 2 * (16 + 20 + 16) * 2 * 4
    # Router 8·4, then 2 experts × (gate, up, down) 3·8·5 per token and layer; the shared expert 3·8·5.
    assert c.flops["routed experts"] == 2 * 3 * 4 * (8 * 4 + 2 * 3 * 8 * 5)
    assert c.flops["shared expert"] == 2 * 3 * 4 * (3 * 8 * 5)
    # Two mixers (before the attention and the FFN) per token and layer, each a linear 16 → 8, the collapse
    # 2·8, the combine 2·2·8 and the post 2·8.
    assert c.flops["hyper-connections"] == 2 * 3 * 4 * 2 * (16 * 8 + 16 + 32 + 16)
    # The last token's head: its mixer 16 → 2, the collapse 2·8, the output projection 8 → 16.
    assert c.flops["output head"] == 2 * (32 + 16 + 128)
    assert c.weight_flops["attention"] == 0 and c.weight_flops["output head"] == 2 * (32 + 128)
    assert c.total_flops == 25756
    # Written: 4 raw rows of 4 per layer, and on ratio 4 one row of 4 and one indexer row of 2; 4 bytes a value.
    assert c.kv_bytes_written == 4 * (3 * 16 + 4 + 2)
    # The window is full from position 4: the 4 raw rows replace 4 (no growth there).
    assert c.kv_bytes_growth == 4 * (4 + 2)
    # Read: the 3 raw rows before the chunk that its first query sees and the chunk's 4, per layer; ratio 4's
    # 2 compressed rows and 2 indexer rows.
    assert c.kv_bytes_read == 4 * (3 * 7 * 4 + 2 * 4 + 2 * 2)


def test_bad_chunks_are_refused():
    with pytest.raises(ValueError, match="n must be a whole number, at least 1, got 0"):
        chunk_cost(TINY, 0, 0, types={})
    # sizes that priced nothing, or less than nothing (chunk 0, -4 bytes a value, a negative chunk of activations)
    for kw, field in ((dict(chunk=0), "chunk"), (dict(kv_bytes_per_value=-4), "kv_bytes_per_value"),
                      (dict(start=1.5), "start")):
        with pytest.raises(ValueError, match=f"{field} must be a whole number"):
            chunk_cost(TINY, **dict(dict(start=0, n=4, types={}), **kw))
    with pytest.raises(ValueError, match="n must be a whole number, at least 1, got -10"):
        activation_bytes(TINY, -10, 256, 64)
    with pytest.raises(TypeError, match=r"a ModelConfig \(model.config\), not Model"):
        chunk_cost(ds4lab.load(backend="numpy"), 0, 4)
    with pytest.raises(ValueError, match="exceed the context of 8"):
        chunk_cost(TINY, 4, 5, types={}, ctx=8)
    with pytest.raises(ValueError, match="not part of a model"):
        weight_nbytes(TINY, {"blk.9.attn_kv.weight": Q.F32})


@pytest.fixture(scope="module")
def model():
    return ds4lab.load(backend="numpy")


@pytest.fixture(scope="module")
def prompt(model):
    text = (testing.data_file("tinyshakespeare.txt").read_text()[:4000])
    return model.tokenizer.encode(text)[:PROMPT_TOKENS]


def test_weight_bytes_are_the_files(model):
    """Every tensor's bytes from the config's shapes and the file's types equal the GGUF's; a chunk reads all but
    the embedding and hash tables (its tokens' rows) and the experts it routes to (all 8 for 64 tokens × 2, 2 for
    one token)."""
    cfg, tensors = model.config, model.file.tensors
    assert weight_nbytes(cfg, file_types(model.file)) == {n: t.nbytes for n, t in tensors.items()}
    total = sum(t.nbytes for t in tensors.values())
    rows = [n for n in tensors if n == "token_embd.weight" or n.endswith("tid2eid.weight")]
    experts = [n for n in tensors if n.endswith("_exps.weight")]
    row_bytes = sum(tensors[n].nbytes // cfg.n_vocab for n in rows)
    every = total - sum(tensors[n].nbytes for n in rows)
    assert chunk_cost(cfg, 0, 64, file_types(model.file)).weight_bytes == every + 64 * row_bytes
    one = chunk_cost(cfg, 100, 1, file_types(model.file)).weight_bytes
    assert one == every - sum(tensors[n].nbytes for n in experts) * (cfg.n_expert - 2) // cfg.n_expert + row_bytes


def test_q2_types_are_the_flash_layout():
    """The q2 types are those of the Flash layout the sparse-model writer makes, and add up to its 81 GiB."""
    layout = {name: Q(qtype) for name, _, qtype, _ in
              testing.model_tensors(FLASH, filled=lambda name: False, router_bias_layers=range(3, 43))}
    assert q2_types(FLASH) == layout
    assert sum(weight_nbytes(FLASH, layout).values()) / 2**30 == pytest.approx(80.76, abs=0.01)


def _prefill_counting_linears(model, prompt, monkeypatch, chunk=64):
    """Run a prefill on a model whose numpy linears add 2·rows·in·out to a counter; the counts per chunk."""
    counted = [0]
    plain = NumpyBackend.linear

    def counting(self, raw, qtype, ne0):
        product = plain(self, raw, qtype, ne0)

        def run(x):
            y = product(x)
            counted[0] += 2 * (x.size // x.shape[-1]) * x.shape[-1] * y.shape[-1]
            return y

        return run

    monkeypatch.setattr(NumpyBackend, "linear", counting)
    fresh = ds4lab.load(model.path, backend="numpy")  # its linears are made (and counted) from now on
    sess = fresh.session(ctx=512, prefill_chunk=chunk)
    per_chunk = []
    for c in sess.prefill(prompt):
        per_chunk.append((c, counted[0] - sum(n for _, n in per_chunk)))
    return fresh, per_chunk


def test_weight_flops_are_the_backends_products(model, prompt, monkeypatch):
    """Exact, chunk by chunk. ds4lab runs the indexer's weights whenever the layer's capacity exceeds top-k
    (ctx 512: 130 rows > 32); the model counts them once a query sees more than top-k rows, as ds4 does, so
    the chunks that end before position 132 run exactly the indexer's products more."""
    fresh, per_chunk = _prefill_counting_linears(model, prompt, monkeypatch)
    cfg = fresh.config
    indexer = 2 * (cfg.q_lora * cfg.idx_heads * cfg.idx_dim + cfg.n_embd * cfg.idx_heads)
    ratio4 = sum(cfg.has_indexer(il) for il in range(cfg.n_layer))
    for c, measured in per_chunk:
        predicted = sum(chunk_cost(cfg, c.start, c.n_tokens, file_types(fresh.file), ctx=512).weight_flops.values())
        early = c.end // 4 <= cfg.idx_topk
        assert measured == predicted + (indexer * ratio4 * c.n_tokens if early else 0), (c.start, c.end)
    assert sum(not (c.end // 4 <= cfg.idx_topk) for c, _ in per_chunk) >= 3


def test_attention_flops_are_the_visible_keys(model, prompt):
    """The attention's FLOPs are 4·H·D per (query, key) pair the model lets a query see, counted from the
    visibility masks the session's attention used (raw window, compressed rows, the indexer's top-k)."""
    cfg = model.config
    sess = model.session(ctx=512, prefill_chunk=64)
    with sess.capture(["attn.scores"], heads=[0]) as cap:
        chunks = sess.prefill(prompt).run(progress=False)
    seen = sum(int(np.asarray(r.value["visible"]).sum()) for il in range(cfg.n_layer)
               for r in cap.records(f"blk.{il}.attn.scores"))
    predicted = sum(chunk_cost(cfg, c.start, c.n_tokens, file_types(model.file), ctx=512).flops["attention"]
                    for c in chunks)
    assert predicted == 4 * cfg.n_head * cfg.head_dim * seen


def test_kv_bytes_are_the_sessions(model, prompt):
    """Bytes written are the rows each chunk reports writing; the growth is the growth of the session's state
    (its DSV4 payload size, less the 4 bytes of each new token id), exactly."""
    cfg = model.config
    sess = model.session(ctx=512, prefill_chunk=48)
    before = sess.kv.nbytes if len(sess.tokens) else None
    sizes = [before]
    costs = []
    for c in sess.prefill(prompt):
        cost = chunk_cost(cfg, c.start, c.n_tokens, file_types(model.file), ctx=512)
        rows = sum(r["raw"] * cfg.head_dim + r["comp"] * cfg.head_dim + r["index"] * cfg.idx_dim
                   for r in c.rows.values())
        assert cost.kv_bytes_written == 4 * rows
        sizes.append(sess.kv.nbytes)
        costs.append((c, cost))
    assert sizes[-1] == costs[-1][0].kv_bytes
    for (c, cost), (prev, _) in zip(costs[1:], costs):
        assert c.kv_bytes - prev.kv_bytes - 4 * c.n_tokens == cost.kv_bytes_growth
    first, cost0 = costs[0]
    assert sum(cost.kv_bytes_growth for _, cost in costs) == costs[-1][0].kv_bytes - payload_nbytes(
        cfg, 0) - 4 * len(prompt) and first.start == 0


def test_activation_peak_within_a_factor_of_tracemalloc(model, prompt):
    """The reference path's peak while one chunk runs (tracemalloc, the weights already converted by an earlier
    prefill) is within a factor 1.5 of the model's (its scores over every slot, the hidden state in and out)."""
    sess = model.session(ctx=512, prefill_chunk=64)
    sess.prefill(prompt[:256]).run(progress=False)  # converts the weights and experts the chunks will use
    tracemalloc.start()
    try:
        step = sess.prefill(prompt[:256 + 64])
        tracemalloc.reset_peak()
        start = tracemalloc.get_traced_memory()[0]
        c = step.step()
        peak = tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()
    predicted = chunk_cost(model.config, c.start, c.n_tokens, file_types(model.file), ctx=512, chunk=64)
    assert predicted.activation_bytes / 1.5 < peak < predicted.activation_bytes * 1.5, (peak,
                                                                                         predicted.activation_bytes)


def test_prefill_and_flash_table():
    chunks = prefill_costs(NANO, 300, 128, types=dict.fromkeys(NANO.tensor_specs(), Q.F32))
    assert [(c.start, c.tokens) for c in chunks] == [(0, 128), (128, 128), (256, 44)]
    rows = flash_table()
    assert [r["step"] for r in rows] == ["prefill chunk of 2048", "decode step"]
    chunk, decode = rows
    # A decode step reads the dense weights and 6 of 256 experts a layer; a chunk of 2048 reads every expert.
    assert chunk["weights_GiB"] == pytest.approx(80.76 - 129280 * 4096 * 2 / 2**30 + 2048 * 4096 * 2 / 2**30, abs=0.02)
    assert decode["weights_GiB"] < chunk["weights_GiB"] / 8
    assert chunk["flop_per_byte"] > 100 * decode["flop_per_byte"]
    assert set(PARTS) <= {k.removesuffix(" GFLOP") for k in chunk}
