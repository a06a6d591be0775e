"""Capture: named hook points, attention maps materialised for a selection and checked against the fused path."""

import numpy as np
import pytest

import ds4lab


@pytest.fixture(scope="module")
def model(model_paths):
    return ds4lab.load(model_paths["nano"], backend="numpy")


def _prompt(n, vocab):
    return (np.arange(n) * 7 + 3) % (vocab - 10) + 5


def test_no_observer_outside_capture(model):
    sess = model.session(ctx=256, prefill_chunk=32)
    with sess.capture(["attn.scores", "head.logits"]):
        assert model.transformer.observer is not None
        assert "head" in model.transformer.__dict__
    assert model.transformer.observer is None and "head" not in model.transformer.__dict__


@pytest.mark.parametrize("chunk", [32, 48])
def test_attention_map_matches_fused_output(model, chunk):
    cfg = model.config
    ids = _prompt(150, cfg.n_vocab)
    sess = model.session(ctx=256, prefill_chunk=chunk)
    pre = sess.prefill(ids)
    pre.step()
    heads = [0, cfg.n_head - 1]
    with sess.capture(["attn.scores", "attn.out", "attn.heads"], heads=heads, queries=range(20, 140)) as cap:
        pre.run(progress=False)
    for il in range(cfg.n_layer):
        amap = cap.attention(il)
        out = cap[f"blk.{il}.attn.out"]
        assert out.shape == (len(amap.queries), len(heads), cfg.head_dim)
        assert np.array_equal(amap.queries, cap.positions(f"blk.{il}.attn.out"))
        assert amap.queries.min() >= 20 and amap.queries.max() < 140
        np.testing.assert_allclose(amap.output(), out, atol=1e-9, rtol=0)
        np.testing.assert_allclose(amap.weights.sum(-1), 1.0, atol=1e-12)
        # raw keys only inside each query's window, compressed rows only once complete
        raw = amap.group("raw").transpose(1, 0, 2)  # [H, Q, keys]
        dist = amap.queries[:, None] - amap.raw_positions[None, :]
        assert np.all(raw[:, (dist < 0) | (dist >= cfg.swa)] == 0)
        R = cfg.ratio(il)
        if R:
            comp = amap.group("comp").transpose(1, 0, 2)
            n_vis = (amap.queries + 1) // R
            assert np.all(comp[:, np.arange(amap.n_comp)[None, :] >= n_vis[:, None]] == 0)
            assert np.all(comp[:, ~amap.selected] == 0)
        labels = amap.labels()
        assert len(labels) == amap.weights.shape[-1] and labels[-1] == "sink"


def test_indexer_selects_top_k(model):
    cfg = model.config
    il = next(i for i in range(cfg.n_layer) if cfg.has_indexer(i))
    ids = _prompt(4 * cfg.idx_topk + 40, cfg.n_vocab)
    sess = model.session(ctx=512, prefill_chunk=64)
    q_last = len(ids) - 1
    with sess.capture([f"blk.{il}.attn.scores", f"blk.{il}.indexer.topk"], queries=[q_last]) as cap:
        sess.prefill(ids).run(progress=False)
    amap = cap.attention(il)
    assert amap.candidates.sum() == (q_last + 1) // 4 > cfg.idx_topk
    assert amap.selected.sum() == cfg.idx_topk
    assert np.array_equal(cap[f"blk.{il}.indexer.topk"][0, : amap.n_comp], amap.selected[0])


def test_decode_step_and_other_points(model):
    cfg = model.config
    sess = model.session(ctx=256, prefill_chunk=64)
    sess.prefill(_prompt(70, cfg.n_vocab)).run(progress=False)
    dec = sess.decoder(seed=1)
    with sess.capture(
        ["attn.scores", "attn.out", "moe.experts", "moe.router", "hc_attn.comb", "head.logits"], layers=[0, 2], heads=1
    ) as cap:
        step = dec.step()
    assert sorted({int(n.split(".")[1]) for n in cap.names if n.startswith("blk.")}) == [0, 2]
    amap = cap.attention(2)
    assert list(amap.queries) == [step.position]
    np.testing.assert_allclose(amap.output(), cap["blk.2.attn.out"], atol=1e-9, rtol=0)
    assert cap["blk.0.moe.experts"].shape == (1, cfg.n_expert_used)
    assert cap["blk.2.hc_attn.comb"].shape == (1, cfg.n_hc, cfg.n_hc)
    np.testing.assert_allclose(cap["head.logits"][0], sess.logits, rtol=1e-6, atol=1e-6)
    with pytest.raises(KeyError):
        cap["blk.1.attn.out"]


def test_capture_does_not_change_results(model):
    cfg = model.config
    ids = _prompt(100, cfg.n_vocab)
    a = model.session(ctx=256, prefill_chunk=32)
    a.prefill(ids).run(progress=False)
    b = model.session(ctx=256, prefill_chunk=32)
    with b.capture(["attn.scores", "moe.experts"], queries=range(40, 60)):
        b.prefill(ids).run(progress=False)
    assert np.array_equal(a.logits, b.logits)
