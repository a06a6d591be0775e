"""Focused checks, inside the real forward pass, of the details of docs/MODEL.md easiest to get wrong, on
the numpy float64 backend, recomputing each quantity independently from activations recorded at the named
points."""

import numpy as np
import pytest

import ds4lab
from ds4lab.model import numerics as nx
from ds4lab.model.rope import RopeParams
from ds4lab.quants import dequantize


@pytest.fixture(scope="module")
def nano_exact(model_paths):
    return ds4lab.load(model_paths["nano"], backend="numpy", numerics="exact")


@pytest.fixture(scope="module")
def nano_ds4(model_paths):
    return ds4lab.load(model_paths["nano"], backend="numpy", numerics="ds4")


def weight(model, name):
    t = model.file.tensors[name]
    return dequantize(t.data, t.qtype, t.shape[0]).astype(np.float64)


def run_recorded(model, ids):
    rec = {}
    X, cache = model.runtime.forward(np.asarray(ids), model.new_state(len(ids) + 1, len(ids)),
                                     observer=lambda name, value: rec.setdefault(name, np.array(value)))
    return rec, X, cache


def rms(x, w=None):
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)
    return y if w is None else y * w


def test_gguf_weight_orientation(nano_exact):
    # ne0 is the input dim: the numpy weight is reshape(ne1, ne0) and y = W·x.
    t = nano_exact.file.tensors["blk.0.attn_q_a.weight"]
    assert t.shape == (256, 128)
    W = weight(nano_exact, "blk.0.attn_q_a.weight")
    assert W.shape == (128, 256)
    x = np.random.default_rng(0).normal(size=(3, 256))
    np.testing.assert_allclose(nano_exact.transformer.weights.linear("blk.0.attn_q_a.weight")(x), x @ W.T, rtol=1e-12)


def test_stacked_linears_match_each_weight(nano_exact):
    # Weights.linears stacks the tensors of one type (Q8_0 q_a and kv; the F16 compressor and indexer weights)
    # into one matrix per type: every output must still be its own weight's product.
    m = nano_exact
    il = next(i for i in range(m.config.n_layer) if m.config.has_indexer(i))
    names = [f"blk.{il}.{n}.weight" for n in ("attn_q_a", "indexer_compressor_gate", "attn_kv", "attn_compressor_kv",
                                              "indexer.proj")]
    assert len({m.file.tensors[n].qtype for n in names}) == 2
    x = np.random.default_rng(1).normal(size=(3, m.config.n_embd))
    outs = m.transformer.weights.linears(*names)(x)
    assert len(outs) == len(names)
    for name, y in zip(names, outs):
        W = weight(m, name)
        assert y.shape == (3, W.shape[0]), name
        np.testing.assert_allclose(y, x @ W.T, rtol=1e-12, atol=1e-12, err_msg=name)


def test_q_and_kv_norms(nano_exact):
    rec, _, _ = run_recorded(nano_exact, [5, 9, 200])
    a, qr, q, kv = (rec[f"blk.1.{k}"] for k in ("attn_norm", "attn.q_lora", "attn.q", "attn.kv_in"))
    m = nano_exact
    np.testing.assert_allclose(
        qr, rms(a @ weight(m, "blk.1.attn_q_a.weight").T, weight(m, "blk.1.attn_q_a_norm.weight")), rtol=1e-10)
    # per-head, unweighted RMSNorm of q over head_dim
    q_raw = (qr @ weight(m, "blk.1.attn_q_b.weight").T).reshape(3, 4, 128)
    np.testing.assert_allclose(q, rms(q_raw), rtol=1e-10)
    np.testing.assert_allclose(
        kv, rms(a @ weight(m, "blk.1.attn_kv.weight").T, weight(m, "blk.1.attn_kv_a_norm.weight")), rtol=1e-10)


def rotate(x, pos, params, sign=1.0):
    """RoPE by hand: interleaved pairs of the last 64 dims, angle from the layer's tables."""
    cos, sin = (t.astype(np.float64) for t in params.tables(np.atleast_1d(pos)))
    y = x.copy()
    t0, t1 = x[..., 64::2], x[..., 65::2]
    c = cos.reshape(cos.shape[0], *([1] * (x.ndim - 2)), 32) if x.ndim > 1 else cos[0]
    s = sign * (sin.reshape(sin.shape[0], *([1] * (x.ndim - 2)), 32) if x.ndim > 1 else sin[0])
    y[..., 64::2], y[..., 65::2] = t0 * c - t1 * s, t0 * s + t1 * c
    return y


def test_attention_output_is_inverse_roped(nano_exact):
    # Recompute layer 0's attention at position 39 (window of 32 raw rows, sinks) from the recorded
    # q and kv, and check that the heads handed to the output projection are rotated back by −θ(39).
    m = nano_exact
    ids = np.random.default_rng(6).integers(0, 1000, 40)
    rec, _, _ = run_recorded(m, ids)
    params = RopeParams.for_layer(m.config, 0)
    q = rotate(rec["blk.0.attn.q"][39], 39, params)  # [H, D]
    keys = rotate(rec["blk.0.attn.kv_in"][8:40], np.arange(8, 40), params)  # exact numerics: stored as is
    sinks = weight(m, "blk.0.attn_sinks.weight")
    s = q @ keys.T / np.sqrt(128)
    mx_ = np.maximum(s.max(1), sinks)
    e = np.exp(s - mx_[:, None])
    out = e @ keys / (np.exp(sinks - mx_) + e.sum(1))[:, None]
    np.testing.assert_allclose(rec["blk.0.attn.heads"][39], rotate(out, 39, params, sign=-1.0), rtol=1e-9, atol=1e-12)
    assert np.abs(out[:, 64:] - rec["blk.0.attn.heads"][39][:, 64:]).max() > 1e-3  # the inverse rotation matters


def test_compressor_ape_on_score_only_and_rope_at_window_start(nano_exact):
    m, il, R = nano_exact, 3, 128  # a ratio-128 layer
    ids = np.random.default_rng(3).integers(0, 1000, 256)
    rec, _, cache = run_recorded(m, ids)
    p = f"blk.{il}.attn_compressor"
    a = rec[f"blk.{il}.attn_norm"]
    ape = weight(m, p + "_ape.weight")  # [R, W]
    np.testing.assert_allclose(rec[p + ".kv"], a @ weight(m, p + "_kv.weight").T, rtol=1e-10)
    np.testing.assert_allclose(rec[p + ".score"], a @ weight(m, p + "_gate.weight").T + ape[np.arange(256) % R],
                               rtol=1e-10)
    # recompute row 1 (window 128..255): per-channel softmax pooling, norm, RoPE at position 128
    kv, sc = rec[p + ".kv"][128:], rec[p + ".score"][128:]
    w = np.exp(sc - sc.max(0)) / np.exp(sc - sc.max(0)).sum(0)
    row = rms((w * kv).sum(0), weight(m, p + "_norm.weight"))
    cos, sin = RopeParams.for_layer(m.config, il).tables(np.array([128]))
    t0, t1 = row[64::2].copy(), row[65::2].copy()
    row[64::2], row[65::2] = t0 * cos[0] - t1 * sin[0], t0 * sin[0] + t1 * cos[0]
    np.testing.assert_allclose(cache.layers[il].comp[1], row, rtol=1e-6, atol=1e-9)


def test_indexer_uses_normalized_q_lora_and_attn_norm(nano_exact):
    m, il = nano_exact, 2
    ids = np.random.default_rng(4).integers(0, 1000, 100)
    rec, _, cache = run_recorded(m, ids)
    qr, a = rec[f"blk.{il}.attn.q_lora"], rec[f"blk.{il}.attn_norm"]
    q = (qr @ weight(m, f"blk.{il}.indexer.attn_q_b.weight").T).reshape(100, 4, 128)
    cos, sin = RopeParams.for_layer(m.config, il).tables(np.arange(100))
    t0, t1 = q[..., 64::2].copy(), q[..., 65::2].copy()
    q[..., 64::2] = t0 * cos[:, None] - t1 * sin[:, None]
    q[..., 65::2] = t0 * sin[:, None] + t1 * cos[:, None]
    w = a @ weight(m, f"blk.{il}.indexer.proj.weight").T / np.sqrt(4 * 128)
    K = cache.layers[il].index
    want = (np.maximum(np.einsum("thd,cd->thc", q, K), 0) * w[:, :, None]).sum(1)
    np.testing.assert_allclose(rec[f"blk.{il}.indexer.scores"], want, rtol=1e-8, atol=1e-10)


def test_hash_layers_route_by_token_id(nano_exact):
    ids = [3, 500, 3, 77]
    rec, _, _ = run_recorded(nano_exact, ids)
    for il in range(3):
        table = nano_exact.file.tensors[f"blk.{il}.ffn_gate_tid2eid.weight"]
        want = dequantize(table.data, table.qtype, table.shape[0])[ids]
        np.testing.assert_array_equal(rec[f"blk.{il}.moe.experts"], want)
    assert rec["blk.3.moe.experts"].shape == (4, 2)  # a top-k layer selects n_expert_used


def test_stored_rows_carry_ds4_numerics(nano_ds4):
    ids = np.random.default_rng(5).integers(0, 1000, 140)
    _, _, cache = run_recorded(nano_ds4, ids)
    layer = cache.layers[2]
    for rows in (layer.raw, layer.comp, layer.index):
        np.testing.assert_array_equal(nx.f16_round(np, rows), rows)  # F16-exact
    # attention rows: FP8-exact on the 64 non-RoPE dims, per 64-block
    for rows in (layer.raw, layer.comp):
        np.testing.assert_array_equal(nx.fp8_kv_sim(np, rows, 64), rows)
    # indexer rows: FP4 grid values in the Hadamard domain
    np.testing.assert_array_equal(nx.fp4_sim(np, layer.index), layer.index)


def test_the_benchmarks_sparse_file_gives_the_indexer_distinct_scores(tmp_path):
    """flash_full.py's file (testing.routing_filled) leaves the big projections holes, but the indexer's queries
    (attn_q_a's rows through its own q_b) and keys are random, so each query's scores differ row to row as real
    weights' do: with attn_q_a a hole every score was 0, every row tied, the top-k's slowest case."""
    from ds4lab import testing
    from tests.conftest import CONFIGS

    cfg = CONFIGS["nano"][0]
    path = testing.make_sparse_model(cfg, tmp_path / "sparse.gguf", seed=1, filled=testing.routing_filled)
    model = ds4lab.load(path, backend="numpy")
    ids = np.random.default_rng(5).integers(0, 1000, 64)
    rec, _, _ = run_recorded(model, ids)
    layers = [il for il in range(cfg.n_layer) if cfg.has_indexer(il)]
    assert layers
    for il in layers:
        last = rec[f"blk.{il}.indexer.scores"][-1][:64 // cfg.compress_ratios[il]]  # the rows the last query sees
        assert len(np.unique(last)) > len(last) // 2, (il, last)  # a few heads here: a row may score 0 (relu)
