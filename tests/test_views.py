"""Widget models in Python: traits after each step, the attention buffer against a reference reduction,
static fallbacks in every mimebundle."""

import base64
import zlib

import numpy as np
import pytest

pytest.importorskip("anywidget")
import ds4lab  # noqa: E402
from ds4lab.visibility import DROPPED, KEPT, UNKNOWN  # noqa: E402
from ds4lab.viz import AttentionView, KVCacheView, MaskView, PrefillView  # noqa: E402
from ds4lab.viz.attention_figure import (  # noqa: E402
    GAP,
    HEIGHT,
    MARK_DROPPED,
    MARK_MASKED,
    MARK_NOT_YET,
    MIN_CELL,
    SINK_PX,
    WIDTH,
)
from ds4lab.viz.reduce import column_factor, edges, maxpool, png_bytes, pool_groups  # noqa: E402

WIDGET = "application/vnd.jupyter.widget-view+json"


@pytest.fixture(scope="module")
def model(model_paths):
    return ds4lab.load(model_paths["nano"], backend="numpy")


def _ids(n, vocab):
    return ((np.arange(n) * 7 + 3) % (vocab - 10) + 5).tolist()


def test_front_end_files_exist():
    from ds4lab.viz.base import STYLESHEET, widgets_dir

    for name in ("prefill.js", "kvcache.js", "mask.js", "attention.js", STYLESHEET):
        assert (widgets_dir() / name).is_file()
        if name.endswith(".js"):
            assert (
                "export default" in (widgets_dir() / name).read_text()
                and "http" not in (widgets_dir() / name).read_text()
            )


def test_prefill_view_steps_with_the_cache_and_mask_beside(model):
    sess = model.session(ctx=256, prefill_chunk=32)
    view = PrefillView(sess, _ids(100, model.config.n_vocab))
    m, kv = view.model, view.kv_view
    assert m.bounds == [[0, 32], [32, 64], [64, 96], [96, 100]] and m.total == 100 and m.done == 0
    assert len(m.tokens) == 100 and m.selected == -1 and kv.model.data["n_tokens"] == 0
    assert view.layer == 2 and kv.model.layers == [2]  # the first layer with an indexer
    view.step()
    assert m.done == 32 and len(m.chunks) == 1 and m.selected == 0
    d = kv.model.data
    assert d["n_tokens"] == 32 and d["label"] == "after chunk 0 (tokens 0–31)" and d["new_from"] == 0
    assert "after chunk 0 (tokens 0–31)</b>" in view.state.value
    view.run()
    assert m.done == 100 and [c["end"] for c in m.chunks] == [32, 64, 96, 100] and m.selected == 3
    assert m.chunks[-1]["kv_bytes"] == sess.kv_bytes
    d = kv.model.data
    assert d["n_tokens"] == 100 and d["total_bytes"] == sess.kv.nbytes and d["new_from"] == 96
    geo = sess.geometry
    assert len(d["slots"]) == geo.raw_cap and d["pointer"] == 100 % geo.raw_cap and d["evicted"] == 0
    assert all(p == -1 or p % geo.raw_cap == s for s, p in enumerate(d["slots"]))
    for L, lk in zip(d["layers"], sess.kv):
        assert L["live"] == [int(lk.raw_positions[0]), int(lk.raw_positions[-1])]
        assert L["n_comp"] == lk.n_comp and L["bytes"] == lk.nbytes
        if lk.ratio:
            assert L["pending"] == list(range(100 - 100 % lk.ratio, 100))
    # scrubbing to an earlier chunk shows its checkpoint, outlines what it wrote, and leaves the session alone
    view.slider.value = 1
    assert kv.model.data["n_tokens"] == 64 and kv.model.data["new_from"] == 32 and len(sess.tokens) == 100
    assert kv.model.data["label"] == "after chunk 1 (tokens 32–63)" and m.selected == 1
    mask = view.mask_view.mask
    assert (mask.layer, mask.pos0, len(mask.queries)) == (2, 32, 32)
    assert view.mask_view.model.label.startswith("chunk 1")
    view.show_layer(3)
    assert view.mask_view.mask.layer == 3 and kv.model.layers == [3]
    bundle = view._repr_mimebundle_()
    html = bundle["text/html"]
    assert WIDGET in bundle and "Prefill: 100/100 tokens, 4/4 chunks run · shown: after chunk 1 (tokens 32–63)" in html
    assert "KV cache after chunk 1 (tokens 32–63): 64 tokens" in html and "data:image/png;base64," in html


def test_prefill_mask_uses_the_indexer_choices_of_its_own_steps(model):
    """The mask of a chunk shows which rows the indexer kept, as captured while the view stepped; the same chunk
    run again under an attention capture attends exactly those keys."""
    cfg = model.config
    sess = model.session(ctx=512, prefill_chunk=64)
    view = PrefillView(sess, _ids(192, cfg.n_vocab))
    view.run()
    mask = view.mask_view.mask
    assert mask.selected is not None and (mask.cells == DROPPED).any()  # from position 131 on
    other = model.session(ctx=512, prefill_chunk=64)
    p = other.prefill(_ids(192, cfg.n_vocab))
    p.step(), p.step()
    with other.capture(["attn.scores"], layers=[2], heads=[0]) as cap:
        p.step()
    np.testing.assert_array_equal(cap.attention(2).weights[:, 0, :] > 0, mask.seen)
    # its KV view marks the rows the chunk's last query attends, from the same captures
    kv = next(L for L in view.kv_view.model.data["layers"] if L["layer"] == view.layer)
    last = view._topk[-1][view.layer][-1]  # the indexer's choice for position 191, captured by the view's step
    assert kv["picked"] == np.nonzero(last[:kv["n_comp"]])[0].tolist() and len(kv["picked"]) == cfg.idx_topk


def test_mask_legend_says_kept_only_where_an_indexer_chooses(model):
    """A compressed row a query sees is "kept" in the legend on an indexer's layer; on a layer without one (ratio
    128) it is "seen (no indexer here)": a walk-through read "kept" there as the indexer's choice."""
    cfg = model.config
    view = PrefillView(model.session(ctx=512, prefill_chunk=64), _ids(192, cfg.n_vocab))
    view.run()
    for layer in range(cfg.n_layer):
        view.show_layer(layer)
        names = view.mask_view.model.categories
        has_indexer = bool(cfg.ratio(layer)) and cfg.has_indexer(layer)
        assert ("kept" in names) == has_indexer and ("seen (no indexer here)" in names) != has_indexer, layer
        if cfg.ratio(layer) and not has_indexer:
            assert "seen (no indexer here)" in view.mask_view.static_html()
    # a ratio-4 layer's first chunk: no query sees more than the indexer's top k rows, so it keeps them all
    layer = next(il for il in range(cfg.n_layer) if cfg.ratio(il) == 4 and cfg.has_indexer(il))
    first = MaskView.of_step(view.session, layer, 0, 64)
    cells = first.mask.cells
    assert (cells == KEPT).any() and not np.isin(cells, [DROPPED, UNKNOWN]).any()
    assert f"seen (≤ {cfg.idx_topk} visible: the indexer keeps all)" in first.model.categories
    assert "kept" not in first.model.categories


def test_views_stay_at_their_cell_unless_they_follow(model):
    sess = model.session(ctx=256, prefill_chunk=32)
    kv = KVCacheView(sess)
    follows = KVCacheView(sess, follow=True)
    fresh = KVCacheView(sess)
    assert fresh.model.data["new_from"] == fresh.model.data["n_tokens"] == 0  # a fresh view outlines nothing
    sess.prefill(_ids(70, model.config.n_vocab)).run(progress=False)
    assert kv.model.data["n_tokens"] == 0 and "0 tokens" in kv.static_html()
    assert follows.model.data["n_tokens"] == 70 and follows.model.data["new_from"] == 64
    late = KVCacheView(sess)
    assert late.model.data["n_tokens"] == 70 and late.model.data["new_from"] == 70
    follows.detach()
    assert sess.step_observers == [] and follows.follow is False
    # a PrefillView displayed after .run() shows its chunks in its fallback
    other = model.session(ctx=256, prefill_chunk=32)
    view = PrefillView(other, _ids(70, model.config.n_vocab))
    view.run()
    html = view._repr_mimebundle_()["text/html"]
    assert "70/70 tokens, 3/3 chunks run" in html and all(f"<td>{r}</td>" in html for r in ("0–31", "32–63", "64–69"))


def test_widget_and_code_share_one_story(model):
    """Every chunk run: a step (button or code) returns the last chunk and says so; once the session moved on the
    buttons only scrub, and a click's error shows inside the widget instead of the log console."""
    sess = model.session(ctx=256, prefill_chunk=32)
    view = PrefillView(sess, _ids(70, model.config.n_vocab))
    view.run_button.click()
    assert view.model.done == 70 and view.step_button.disabled and view.run_button.disabled
    last = view.step()  # the next cell's prefill.step()
    assert last is view.chunks[-1] and view.model.note == "all 3 chunks are run: showing after chunk 2 (tokens 64–69)"
    assert view.run() == view.chunks and len(view.chunks) == 3
    view.slider.value = 0
    assert view.kv_view.model.data["n_tokens"] == 32
    # a view whose session moves on under it
    s2 = model.session(ctx=256, prefill_chunk=32)
    v2 = PrefillView(s2, _ids(70, model.config.n_vocab))
    v2.step()
    s2.sync(_ids(40, model.config.n_vocab)[:33] + [9])
    v2.step_button.click()  # what a reader does: no traceback in a log, a line in the view
    line = v2.widget.children[-1]
    assert "RuntimeError: the session moved on (34 tokens" in line.value and "ds4-error" in line.value
    assert v2.step_button.disabled and v2.run_button.disabled and "only scrub" in v2.model.note
    with pytest.raises(RuntimeError, match="moved on"):
        v2.step()
    v2.select(0)  # scrubbing still works
    assert v2.kv_view.model.data["n_tokens"] == 32
    # a new view of the prompt its session holds already (the cell that made it run again): nothing to step, said
    # at once, not by a stepper of no chunks
    with pytest.raises(ValueError, match="already holds all 70 tokens of this prompt: nothing to prefill"):
        PrefillView(sess, _ids(70, model.config.n_vocab))
    # a view whose prompt the session took whole after it was made (another cell's prefill): a line, no IndexError
    s3 = model.session(ctx=256, prefill_chunk=32)
    v3 = PrefillView(s3, _ids(70, model.config.n_vocab))
    s3.prefill(_ids(70, model.config.n_vocab)).run(progress=False)
    v3.step_button.click()
    line = v3.widget.children[-1].value
    assert "RuntimeError: the session holds this prompt&#x27;s 70 tokens, prefilled elsewhere" in line
    assert v3.step_button.disabled and v3.run_button.disabled
    for call in (v3.step, v3.run):
        with pytest.raises(RuntimeError, match="none of its chunks"):
            call()


def test_kv_slider_agrees_with_the_state_shown(model):
    """The state slider sits on the checkpoint whose state the view shows, whichever way it got there; the title
    names it the way the PrefillView does."""
    sess = model.session(ctx=256, prefill_chunk=32)
    chunks = sess.prefill(_ids(100, model.config.n_vocab)).run(progress=False)
    kv = KVCacheView(sess, checkpoints=chunks)
    s = kv.slider
    assert (s.max, s.value, s.disabled, s.readout, s.description) == (3, 3, False, True, "chunk")
    assert kv.shown_checkpoint == 3 and kv.model.data["label"] == "after chunk 3 (tokens 96–99)"
    assert kv.model.data["new_from"] == 96  # fresh: what chunk 3 wrote outlined, as the slider outlines it
    for i, n in ((1, 64), (0, 32), (2, 96)):
        s.value = i  # the user drags the slider
        d = kv.model.data
        assert d["n_tokens"] == n and d["label"] == f"after chunk {i} (tokens {32 * i}–{n - 1})"
        assert d["new_from"] == 32 * i and kv.shown_checkpoint == i
    kv.scrub(1)  # from Python
    assert s.value == 1 and kv.model.data["n_tokens"] == 64
    with pytest.raises(IndexError, match="checkpoint 4"):
        kv.scrub(4)
    sess.decoder(temperature=0).step()
    assert kv.model.data["n_tokens"] == 64  # it does not follow
    kv.refresh()
    assert kv.model.data["n_tokens"] == 101 and kv.shown_checkpoint is None
    assert kv.model.data["label"] == "of the session" and kv.model.data["new_from"] == 64  # since shown
    # plain checkpoints are named by index and size
    plain = KVCacheView(sess, checkpoints=[c.checkpoint for c in chunks])
    plain.slider.value = 1
    assert plain.model.data["label"] == "checkpoint 1 (64 tokens)"


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
    assert ref.shape == (m.rows, m.cols) and f"max-pooled ×{fr} queries and ×{fc} keys" in m.note
    np.testing.assert_array_equal(view.values, ref)
    buf = np.frombuffer(m.buf, np.uint8).reshape(m.rows, m.cols)
    np.testing.assert_array_equal(buf, np.clip(np.rint(ref / ref.max() * 255), 0, 255).astype(np.uint8))
    np.testing.assert_array_equal(np.frombuffer(m.values, np.float32).reshape(m.rows, m.cols), ref.astype(np.float32))
    assert [g["name"] for g in m.groups] == ["raw", "comp", "sink"] and m.groups[-1]["stop"] == m.cols
    assert len(m.row_labels) == m.rows and len(m.col_labels) == m.cols
    marks = np.frombuffer(m.marks, np.uint8).reshape(m.rows, m.cols)
    comp = slice(m.groups[1]["start"], m.groups[1]["stop"])
    assert (marks[:, comp] == MARK_DROPPED).any()  # the indexer dropped rows
    assert (marks[:, comp] == MARK_NOT_YET).any() and (np.delete(marks, np.r_[comp], axis=1) < MARK_NOT_YET).all()
    np.testing.assert_array_equal(marks == MARK_MASKED, (ref == 0) & ~np.isin(marks, (MARK_DROPPED, MARK_NOT_YET)))
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

    sess = model.session(ctx=256, prefill_chunk=30)  # chunk ends off the count's grid of every 2 tokens
    chunks = sess.prefill(_ids(80, model.config.n_vocab)).run(progress=False)
    spec = kv_bytes_chart(sess, chunks).to_dict()  # the layout's count (solid, then dashed), the chunks' points
    layers = spec["layer"][0]["layer"]  # in one layer of its own colour scale (its legend beside it)
    values = layers[-1]["data"]["values"]
    assert len(values) == len(chunks) * len({model.config.ratio(i) for i in range(model.config.n_layer)})
    # counted from the layout: the bytes the chunks' states hold, at each chunk's end; from no token to the context
    counted = {(r["tokens"], r["kind"]): r["bytes"] for layer in layers[:2] for r in layer["data"]["values"]}
    assert all(counted[r["tokens"], r["kind"]] == r["bytes"] for r in values)
    assert min(t for t, _ in counted) == 0 and max(t for t, _ in counted) == 255
    assert [layer["mark"].get("strokeDash") for layer in layers[:2]] == [None, [4, 3]]
    points = prefill_chunks_chart(chunks).to_dict()["layer"][-1]  # band, median rule, then the chunks' points
    assert len(points["data"]["values"]) == len(chunks)
