"""Capture: named hook points, attention maps materialised for a selection and checked against the fused path."""

import re

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
        assert sess.hook_observer is not None
        # the capture is the session's: the model (shared by every session) is left as it was
        assert not hasattr(model.transformer, "observer") and "head" not in vars(model.transformer)
        assert model.session(ctx=64, prefill_chunk=32).hook_observer is None
    assert sess.hook_observer is None and "head" not in vars(model.transformer)


def test_nested_captures_both_record(model):
    cfg = model.config
    sess = model.session(ctx=256, prefill_chunk=32)
    with sess.capture(["moe.experts", "head.logits"], layers=[1]) as outer:
        sess.prefill(_prompt(40, cfg.n_vocab)).step()
        with sess.capture(["attn.q", "head.logits"], layers=[2]) as inner:
            sess.prefill(_prompt(70, cfg.n_vocab)).step()
        assert sess.hook_observer == outer._observe
    assert sess.hook_observer is None
    assert inner.names == ["blk.2.attn.q", "head.logits"] and outer.names == ["blk.1.moe.experts", "head.logits"]
    assert np.array_equal(outer.positions("head.logits"), [31, 63])
    assert np.array_equal(inner.positions("head.logits"), [63])
    assert np.array_equal(outer["head.logits"][1], inner["head.logits"][0])


def test_two_sessions_on_one_model_capture_what_each_asked_for(model):
    """Each session's capture sees its own steps only, with its own selection, while both are open and their
    steps interleave; what each records equals a capture of that session's steps alone."""
    cfg = model.config
    ids_a, ids_b = _prompt(60, cfg.n_vocab), _prompt(40, cfg.n_vocab)[::-1].copy()
    a, b = model.session(ctx=256, prefill_chunk=32), model.session(ctx=256, prefill_chunk=32)
    pre_a, pre_b = a.prefill(ids_a), b.prefill(ids_b)
    with a.capture(["moe.experts", "attn.scores"], layers=[1], heads=[0], queries=range(10, 50)) as cap_a, \
            b.capture(["attn.q", "head.logits"], layers=[3]) as cap_b:
        while pre_a.remaining or pre_b.remaining:
            for pre in (pre_a, pre_b):
                if pre.remaining:
                    pre.step()
    assert cap_a.names == ["blk.1.attn.scores", "blk.1.moe.experts"]
    assert cap_b.names == ["blk.3.attn.q", "head.logits"]
    assert np.array_equal(cap_a.positions("blk.1.moe.experts"), np.arange(10, 50))
    assert np.array_equal(cap_b.positions("blk.3.attn.q"), np.arange(40))
    assert np.array_equal(cap_b.positions("head.logits"), [31, 39])
    np.testing.assert_array_equal(cap_b["head.logits"][-1].astype(np.float32), b.logits)
    for sess, ids, cap, points, kw in ((a, ids_a, cap_a, ["moe.experts", "attn.scores"],
                                        dict(layers=[1], heads=[0], queries=range(10, 50))),
                                       (b, ids_b, cap_b, ["attn.q", "head.logits"], dict(layers=[3]))):
        alone = model.session(ctx=256, prefill_chunk=32)
        with alone.capture(points, **kw) as ref:
            alone.prefill(ids).run(progress=False)
        assert ref.names == cap.names
        for name in cap.names:
            if name.endswith(".attn.scores"):
                np.testing.assert_array_equal(cap.attention(1).weights, ref.attention(1).weights)
            else:
                np.testing.assert_array_equal(cap[name], ref[name])
        np.testing.assert_array_equal(sess.logits, alone.logits)


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


@pytest.mark.parametrize("points, kwargs, named", [
    (["attn.score"], {}, "unknown hook point 'attn.score'"),
    (["blk.0.attn.score"], {}, "unknown hook point 'blk.0.attn.score'"),
    (["blk.99.attn.scores"], {}, "hook point 'blk.99.attn.scores': layer '99' is not a layer"),
    (["attn.scores"], dict(layers=[99]), "layer 99 does not exist"),
    (["attn.scores"], dict(layers=[-1]), "layer -1 does not exist"),
    (["attn.out"], dict(heads=[999]), "head 999 does not exist"),
])
def test_capture_refuses_what_no_step_emits(model, points, kwargs, named):
    """A misspelled point or a layer the model lacks recorded nothing, silently; a head it lacks failed later with
    an IndexError inside the hooks."""
    sess = model.session(ctx=64, prefill_chunk=16)
    with pytest.raises(ValueError, match=re.escape(named)):
        sess.capture(points, **kwargs)
    with sess.capture(["blk.*.attn.scores", "head.logits", "moe.experts"], layers=slice(0, 2)) as cap:
        sess.prefill(_prompt(8, model.config.n_vocab)).run(progress=False)
    assert {r.name for r in cap.records()} >= {"blk.0.attn.scores", "head.logits", "blk.1.moe.experts"}
