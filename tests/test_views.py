"""Widget models in Python: traits after each step, the attention buffer against a reference reduction,
static fallbacks in every mimebundle."""

import base64
import zlib

import numpy as np
import pytest

pytest.importorskip("anywidget")
import ds4lab  # noqa: E402
from ds4lab.viz import AttentionView, KVCacheView, PrefillView  # noqa: E402
from ds4lab.viz.attention_figure import GAP, HEIGHT, MARK_DROPPED, MARK_MASKED, MIN_CELL, SINK_PX, WIDTH  # noqa: E402
from ds4lab.viz.reduce import column_factor, edges, maxpool, png_bytes, pool_groups  # noqa: E402

WIDGET = "application/vnd.jupyter.widget-view+json"


@pytest.fixture(scope="module")
def model(model_paths):
    return ds4lab.load(model_paths["nano"], backend="numpy")


def _ids(n, vocab):
    return ((np.arange(n) * 7 + 3) % (vocab - 10) + 5).tolist()


def test_front_end_files_exist():
    from ds4lab.viz.base import STYLESHEET, widgets_dir

    for name in ("prefill.js", "kvcache.js", "attention.js", STYLESHEET):
        assert (widgets_dir() / name).is_file()
        if name.endswith(".js"):
            assert (
                "export default" in (widgets_dir() / name).read_text()
                and "http" not in (widgets_dir() / name).read_text()
            )


def test_prefill_and_kv_views_follow_steps(model):
    sess = model.session(ctx=256, prefill_chunk=32)
    kv = KVCacheView(sess)
    assert kv.model.data["n_tokens"] == 0
    view = PrefillView(sess, _ids(100, model.config.n_vocab), kv_view=kv)
    m = view.model
    assert m.bounds == [[0, 32], [32, 64], [64, 96], [96, 100]] and m.total == 100 and m.done == 0
    assert len(m.tokens) == 100
    view.step()
    assert m.done == 32 and len(m.chunks) == 1 and m.selected == 0
    d = kv.model.data
    assert d["n_tokens"] == 32 and d["total_bytes"] == sess.kv.nbytes
    view.run()
    assert m.done == 100 and [c["end"] for c in m.chunks] == [32, 64, 96, 100]
    assert m.chunks[-1]["kv_bytes"] == sess.kv_bytes
    d = kv.model.data
    assert d["n_tokens"] == 100
    geo = sess.geometry
    for L, lk in zip(d["layers"], sess.kv):
        assert len(L["slots"]) == geo.raw_cap
        assert all(p == -1 or p % geo.raw_cap == s for s, p in enumerate(L["slots"]))
        assert L["live"] == [int(lk.raw_positions[0]), int(lk.raw_positions[-1])]
        assert L["n_comp"] == lk.n_comp and L["bytes"] == lk.nbytes
        if lk.ratio:
            assert L["pending"] == list(range(100 - 100 % lk.ratio, 100))
    # scrubbing to an earlier chunk shows its checkpoint and leaves the session alone
    view.slider.value = 1
    assert kv.model.data["n_tokens"] == 64 and len(sess.tokens) == 100
    for v in (view, kv):
        bundle = v._repr_mimebundle_()
        assert WIDGET in bundle and "<table>" in bundle["text/html"]



def test_kv_slider_agrees_with_the_state_shown(model):
    """The checkpoint slider sits on the checkpoint whose state the view shows, whichever way it got there;
    it reads "live" without a number when the state shown is none of its checkpoints."""
    sess = model.session(ctx=256, prefill_chunk=32)
    kv = KVCacheView(sess)
    s = kv.slider
    assert (s.description, s.disabled, s.readout) == ("checkpoint", True, True)
    prefill = PrefillView(sess, _ids(100, model.config.n_vocab), kv_view=kv)
    chunks = prefill.run()
    assert kv.model.data["n_tokens"] == 100 and kv.model.data["label"].startswith("after chunk 3")
    # notebook 02: run, then scrub through the chunks; the display is the live state = the last checkpoint
    kv.scrub_through(chunks)
    assert (s.max, s.value, s.disabled, s.readout, s.description) == (3, 3, False, True, "checkpoint")
    assert kv.shown_checkpoint == 3 and kv.model.data["n_tokens"] == len(chunks[3].checkpoint) == 100
    for i, n in ((1, 64), (0, 32), (2, 96)):
        s.value = i  # the user drags the slider
        assert kv.model.data["n_tokens"] == n and kv.model.data["label"] == f"checkpoint {i}"
        assert kv.shown_checkpoint == i and s.value == i
    kv.scrub(1)  # from Python
    assert s.value == 1 and kv.model.data["n_tokens"] == 64
    prefill.slider.value = 0  # the linked PrefillView's chunk slider moves this one too
    assert s.value == 0 and kv.model.data["n_tokens"] == 32
    kv.refresh()  # the live state again: that is checkpoint 3
    assert s.value == 3 and kv.model.data["n_tokens"] == 100 and kv.model.data["label"] == "live"
    # a decoded token: the live state is none of the checkpoints
    sess.decoder(temperature=0).step()
    assert kv.model.data["n_tokens"] == 101 and kv.shown_checkpoint is None
    assert (s.description, s.readout) == ("live", False)
    s.value = 2
    assert kv.model.data["n_tokens"] == 96 and (s.description, s.readout) == ("checkpoint", True)
    # checkpoints given at construction (chunks or their checkpoints) work alike
    other = KVCacheView(sess, checkpoints=chunks, auto_refresh=False)
    assert other.shown_checkpoint is None and other.slider.description == "live"
    other.slider.value = 1
    assert other.model.data["n_tokens"] == 64 and other.shown_checkpoint == 1
    kv.detach()

def test_attention_buffer_matches_reference_reduction(model):
    sess = model.session(ctx=512, prefill_chunk=64)
    il = next(i for i in range(model.config.n_layer) if model.config.has_indexer(i))
    with sess.capture(["attn.scores"], layers=[il], heads=[1]) as cap:
        sess.prefill(_ids(300, model.config.n_vocab)).run(progress=False)
    view = AttentionView(cap, scale="linear")
    m = view.model
    amap = cap.attention(il)
    w = amap.weights[:, 0, :]
    # reference: rows pooled to fit HEIGHT at MIN_CELL px, each group's columns on its own with one factor that fits
    # the raw and compressed columns into the width left by the sink and the gaps; the sink never pooled
    fr = -(-w.shape[0] // (HEIGHT // MIN_CELL))
    slots = (WIDTH - SINK_PX - 2 * GAP) // MIN_CELL
    fc = next(f for f in range(1, 1000) if -(-amap.n_raw // f) + -(-amap.n_comp // f) <= slots)
    ref = np.concatenate(
        [
            maxpool(w[:, amap.groups["raw"]], fr, fc),
            maxpool(w[:, amap.groups["comp"]], fr, fc),
            maxpool(w[:, amap.groups["sink"]], fr, 1),
        ],
        axis=1,
    )
    assert ref.shape == (m.rows, m.cols) and f"max-pooled ×{fr} queries, ×{fc} keys" in m.note
    np.testing.assert_array_equal(view.values, ref)
    buf = np.frombuffer(m.buf, np.uint8).reshape(m.rows, m.cols)
    np.testing.assert_array_equal(buf, np.clip(np.rint(ref / ref.max() * 255), 0, 255).astype(np.uint8))
    np.testing.assert_array_equal(np.frombuffer(m.values, np.float32).reshape(m.rows, m.cols), ref.astype(np.float32))
    assert [g["name"] for g in m.groups] == ["raw", "comp", "sink"] and m.groups[-1]["stop"] == m.cols
    assert len(m.row_labels) == m.rows and len(m.col_labels) == m.cols
    marks = np.frombuffer(m.marks, np.uint8).reshape(m.rows, m.cols)
    comp = slice(m.groups[1]["start"], m.groups[1]["stop"])
    assert (marks[:, comp] == MARK_DROPPED).any()  # the indexer dropped rows
    np.testing.assert_array_equal(marks == MARK_MASKED, (ref == 0) & (marks != MARK_DROPPED))
    bundle = view._repr_mimebundle_()
    assert WIDGET in bundle and "data:image/png;base64," in bundle["text/html"]
    png = base64.b64decode(bundle["text/html"].split("base64,")[1].split("'")[0])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_reduce_helpers():
    a = np.arange(35, dtype=float).reshape(5, 7)
    np.testing.assert_array_equal(maxpool(a, 2, 3), [[9, 12, 13], [23, 26, 27], [30, 33, 34]])
    assert column_factor([1000, 299], 232) == 6  # ceil(1000/6) + ceil(299/6) = 167 + 50 = 217 <= 232; f=5: 200+60
    red, spans = pool_groups(a, [4, 2, 1], 2, 3, [True, True, False])
    # rows {0,1} {2,3} {4}; columns {0,1,2} {3} | {4,5} | {6}
    np.testing.assert_array_equal(red, [[9, 10, 12, 13], [23, 24, 26, 27], [30, 31, 33, 34]])
    assert spans == [(0, 2), (2, 3), (3, 4)]
    assert edges(3, 10).tolist() == [0, 3, 7, 10]
    png = png_bytes(np.zeros((2, 3, 3), np.uint8))
    assert zlib.decompress(png[png.index(b"IDAT") + 4 : -16]) == b"\x00" + bytes(9) + b"\x00" + bytes(9)


def test_charts(model):
    from ds4lab.viz.charts import kv_bytes_chart, prefill_chunks_chart

    sess = model.session(ctx=256, prefill_chunk=32)
    chunks = sess.prefill(_ids(80, model.config.n_vocab)).run(progress=False)
    spec = kv_bytes_chart(sess, chunks).to_dict()
    assert len(spec["data"]["values"]) == len(chunks) * len(
        {model.config.ratio(i) for i in range(model.config.n_layer)}
    )
    assert len(prefill_chunks_chart(chunks).to_dict()["data"]["values"]) == len(chunks)
