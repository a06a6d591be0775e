"""AttentionView on the standard example (the embedded model, Coriolanus' first 320 tokens, layers 2 and 3, heads
0 and 1): the colour scales against hand-worked cases, the mass split against sums of the map's weights, zooming
against the full-resolution weights, the fixed figure and the static fallback, and the indexer's rows (kept,
dropped, not yet compressed) marked and coloured as the MaskView colours them."""

import re
import struct

import numpy as np
import pytest

pytest.importorskip("anywidget")
from pathlib import Path  # noqa: E402

import ds4lab  # noqa: E402
from ds4lab.viz import AttentionView  # noqa: E402
from ds4lab.viz import attention_figure as fig  # noqa: E402
from ds4lab.viz.attention_figure import FIG_W, LEFT, SINK_PX, TOP, WIDTH, draw_static  # noqa: E402
from ds4lab.viz.pixel_font import ADVANCE, GLYPHS, text_mask  # noqa: E402
from ds4lab.viz.reduce import scale_colours  # noqa: E402

TEXT = Path(__file__).resolve().parent.parent / "data" / "tinyshakespeare.txt"  # begins with Coriolanus
WIDGETS = Path(__file__).resolve().parent.parent / "widgets"


@pytest.fixture(scope="module")
def cap():
    model = ds4lab.load(backend="numpy")
    ids = model.tokenizer.encode(TEXT.read_text(encoding="utf-8")[:4000])[:320]
    sess = model.session(ctx=512, prefill_chunk=64)
    with sess.capture(["attn.scores"], layers=[2, 3], heads=[0, 1]) as c:
        sess.prefill(ids).run(progress=False)
    return c


def test_colour_scales_by_hand():
    idx, lo, hi = scale_colours(np.array([[0.0, 0.5, 1.0]]), "linear")
    assert idx.tolist() == [[0, 128, 255]] and (lo, hi) == (0.0, 1.0)  # 0.5·255 = 127.5 rounds to even 128
    idx, lo, hi = scale_colours(np.array([[0.2, 0.1], [0.0, 0.0], [0.5, 0.25]]), "row")
    assert idx.tolist() == [[255, 128], [0, 0], [255, 128]] and (lo, hi) == (0.0, 1.0)
    # log over 4 decades of max 1: 1 → 255, 0.1 → 3/4 · 255 = 191.25, 1e-4 and below (0 too) → 0
    idx, lo, hi = scale_colours(np.array([[1.0, 0.1, 1e-4, 1e-6, 0.0]]), "log")
    assert idx.tolist() == [[255, 191, 0, 0, 0]] and lo == pytest.approx(1e-4, rel=1e-15) and hi == 1.0
    idx, lo, hi = scale_colours(np.array([[0.02, 0.002]]), "log", decades=2)  # lo = 2e-4: 2e-3 is 1 decade of 2
    assert idx.tolist() == [[255, 128]]
    assert scale_colours(np.zeros((2, 2)), "log")[0].tolist() == [[0, 0], [0, 0]]
    with pytest.raises(ValueError, match="'sqrt'"):
        scale_colours(np.ones((1, 1)), "sqrt")


def test_mass_split_is_the_sums_of_the_weights(cap):
    view = AttentionView(cap, layer=2, head=1)
    for layer in (2, 3):
        amap = cap.attention(layer)
        w = amap.weights[:, 1, :]
        nr, nc = amap.n_raw, amap.n_comp
        ref = np.stack([w[:, :nr].sum(axis=1), w[:, nr : nr + nc].sum(axis=1), w[:, -1]], axis=1)
        np.testing.assert_allclose(view.mass_split(layer, 1), ref, rtol=0, atol=1e-12)
        np.testing.assert_allclose(ref.sum(axis=1), 1.0, rtol=0, atol=1e-12)
    # each shown row: the mean of its pooled queries' split (rows pooled ×2 at 320 queries)
    m, split = view.model, view.mass_split()
    assert m.rows == 160
    np.testing.assert_allclose(m.mass, (split[0::2] + split[1::2]) / 2, rtol=0, atol=1e-12)


def test_the_note_counts_drops_that_pooling_hides(cap):
    """A pooled cell shows its largest weight: where one of its queries attends a compressed row the indexer
    dropped for the other, it is not salmon, and a student read the indexer as acting only late in the prompt.
    The note counts such cells, here from the captured choice in 2 × 2 blocks, as the view pools them."""
    view = AttentionView(cap, layer=2, head=0)
    amap = cap.attention(2)
    w = amap.weights[:, 0, amap.n_raw : amap.n_raw + amap.n_comp]
    dropped = amap.candidates & ~amap.selected
    blocks = lambda x: x.reshape(x.shape[0] // 2, 2, x.shape[1] // 2, 2)  # noqa: E731
    hidden = int(((blocks(w).max(axis=(1, 3)) > 0) & blocks(dropped).any(axis=(1, 3))).sum())
    assert hidden > 0
    note = f"(zoom in for every cell; {hidden:,} pooled cells hide an indexer-dropped row under a weight)"
    assert note in view.model.note
    view.zoom((0, 320), (0, amap.n_raw))  # the raw keys alone, still pooled: no compressed row, none hidden
    assert "max-pooled ×2 queries" in view.model.note and "hide an indexer-dropped" not in view.model.note


def test_axis_labels_fit_their_room(cap):
    """Zoomed in to every cell, a key's label is its position and its token written bottom to top under the
    heatmap: a longer position leaves the token fewer characters (at 4 digits and more it ran into the colour bar),
    none under two; a query's label the same left of the heatmap."""
    from ds4lab.viz.attention_view import X_LABEL_CHARS, Y_LABEL_CHARS

    view = AttentionView(cap, layer=2, head=0)
    view.zoom((100, 136), (56, 92))
    m = view.model
    assert all(len(t) <= X_LABEL_CHARS for _, t in m.xticks) and all(len(t) <= Y_LABEL_CHARS for _, t in m.yticks)
    assert sum("'" in t for _, t in m.xticks) > 10 and sum("'" in t for _, t in m.yticks) > 10  # tokens shown
    tok = repr(view.tokens[123])
    assert view._label(123, 3 + 1 + len(tok), 6) == f"123 {tok}"  # room for all of it
    short = view._label(123, 8, 6)  # room for two characters of it
    assert len(short) <= 8 and short.startswith("123 ") and short == f"123 {repr(view.tokens[123][:2])}"
    assert view._label(123, 6, 6) == "123"  # none under two


def test_zoom_shows_every_cell_of_the_region(cap):
    view = AttentionView(cap, layer=2, head=0)
    w = cap.attention(2).weights[:, 0, :]
    assert "max-pooled ×2 queries and ×2 keys" in view.model.note
    view.zoom((100, 140), (90, 150))
    m = view.model
    assert (m.rows, m.cols) == (40, 60) and "every cell shown" in m.note and "zoomed" in m.note
    np.testing.assert_array_equal(view.values, w[100:140, 90:150])
    sent = np.frombuffer(m.values, np.float32).reshape(40, 60)
    np.testing.assert_array_equal(sent, w[100:140, 90:150].astype(np.float32))
    assert m.row_labels[0].startswith("query 100 ") and m.col_labels[0].startswith("raw key 90 ")
    # across the three groups: raw 300–319 | compressed rows 0–79 | sink, each cell once
    view.zoom((280, 320), (300, 401))
    np.testing.assert_array_equal(view.values, w[280:320, 300:401])
    assert [(g["name"], g["stop"] - g["start"]) for g in m.groups] == [("raw", 20), ("comp", 80), ("sink", 1)]
    # a region dragged on the front-end, in shown cells (pooled ×2 both ways): rows 10–19, columns 5–24
    view.reset_zoom()
    m.zoom_request = [10, 19, 5, 24]
    assert m.zoom_request == [] and view.region == (20, 40, 10, 50)
    np.testing.assert_array_equal(view.values, w[20:40, 10:50])
    m.zoom_request = [-1]
    assert view.region is None and m.rows == 160
    with pytest.raises(ValueError, match="not inside"):
        view.zoom((0, 500))


def test_a_zoomed_view_scales_each_row_by_its_whole_row(cap):
    """"per row" colours a zoomed region's cells over their query's max across all its keys, as the legend says
    ("weight / the query's max"): a zoom on the compressed columns drew each row's largest of them at full strength
    (0.0035 as black), though the row's raw keys held far more."""
    view = AttentionView(cap, layer=2, head=0, scale="row")
    w = cap.attention(2).weights[:, 0, :]
    nr = cap.attention(2).n_raw
    view.zoom((100, 140), (nr, nr + 40))  # compressed rows only
    idx = np.frombuffer(view.model.buf, np.uint8).reshape(40, 40)
    want = np.rint(w[100:140, nr : nr + 40] / w[100:140].max(axis=1, keepdims=True) * 255)
    np.testing.assert_array_equal(idx, want)
    assert (idx.max(axis=1) < 255).any()  # rows whose max lies outside the region
    view.zoom((0, 100), (0, nr))  # 100 queries each shown, the raw keys pooled: the note names only the keys
    assert "max-pooled ×2 keys (zoom in" in view.model.note
    assert view.model.scale_text == "per row: weight / the query's max"


def test_the_figure_keeps_its_size(cap):
    view = AttentionView(cap, layer=2, head=0)
    m = view.model
    shape = (m.geometry, m.row_edges[-1], max(x1 for _, x1 in m.col_edges))
    assert m.geometry["width"] >= 480 and shape[1:] == (480, WIDTH)
    sink = m.groups[-1]
    assert sink["name"] == "sink" and sink["x1"] - sink["x0"] == SINK_PX
    widths = [x1 - x0 for x0, x1 in m.col_edges[:-1]]
    assert min(widths) >= 3 and max(widths) - min(widths) <= 1
    labels = (list(m.row_labels), list(m.col_labels))
    view.show(3, 0)  # 320 raw | 2 compressed | sink
    assert (m.geometry, m.row_edges[-1], max(x1 for _, x1 in m.col_edges)) == shape
    assert m.title.startswith("layer 3 (ratio 128), head 0") and (list(m.row_labels), list(m.col_labels)) != labels
    assert [g["name"] for g in m.groups] == ["raw", "comp", "sink"]
    m.pick_head = 1  # a small multiple clicked
    assert (view.head, m.head, view.head_select.value, m.pick_head) == (1, 1, 1, -1)
    assert len(m.thumbs) == 2 * m.thumb_shape[0] * m.thumb_shape[1] * 3 and m.thumb_heads == [0, 1]
    assert m.yticks and m.xticks and any(text == "sink" for _, text in m.xticks)


def test_a_few_compressed_rows_get_legible_columns_and_headers(cap):
    """A ratio-128 layer's 2 compressed rows are 2 columns (not pooled with the raw window's ×2) at least FEW_PX wide;
    the group headers sit on one line, each over its own group, none overlapping (at HEADER_CHAR px a character,
    which bounds both renderers' fonts), shortened where the full one has no room."""
    view = AttentionView(cap, layer=3, head=0)
    m = view.model
    comp = next(g for g in m.groups if g["name"] == "comp")
    assert comp["stop"] - comp["start"] == 2 and "×2 keys" in m.note  # the raw window still pooled
    assert all(x1 - x0 >= fig.FEW_PX for x0, x1 in m.col_edges[comp["start"] : comp["stop"]])
    assert [t for _, t in m.xticks if t.startswith("c")] == ["c0", "c1"]
    assert [g["label"] for g in m.groups] == ["raw keys 0–319 (320)", "comp", "sink"]  # no "window": it is 64
    for layer, zoom in ((3, None), (2, None), (2, ((280, 320), (300, 401))), (3, ((0, 320), (300, 323)))):
        view.show(layer, 0)
        if zoom:
            view.zoom(*zoom)
        spans = [(g["label_x"] - fig.HEADER_CHAR * len(g["label"]) / 2,
                  g["label_x"] + fig.HEADER_CHAR * len(g["label"]) / 2, g) for g in m.groups]
        assert all(g["label"] and g["x0"] <= g["label_x"] <= g["x1"] and a >= 0 for a, _, g in spans), m.groups
        assert all(b1 + 4 <= a2 for (_, b1, _), (a2, _, _) in zip(spans, spans[1:])), m.groups
        assert spans[-1][1] <= WIDTH + fig.MASS_GAP  # clear of the mass bars' header
    img = draw_static(view._state())  # the static figure: headers on the one line above the group bars, none above
    assert (img[:12, LEFT : LEFT + WIDTH] < 100).all(axis=2).sum() == 0
    assert (img[18:25, LEFT : LEFT + WIDTH] < 100).all(axis=2).sum() > 50
    # one compressed row (200 tokens): one column FEW_PX wide, its short header over it still
    sess = cap.session.model.session(ctx=512, prefill_chunk=64)
    with sess.capture(["attn.scores"], layers=[3], heads=[0]) as one:
        sess.prefill(cap.session.tokens[:200]).run(progress=False)
    m = AttentionView(one).model
    assert [(g["label"], g["stop"] - g["start"]) for g in m.groups] == [("raw keys 0–199 (200)", 200), ("comp", 1),
                                                                          ("sink", 1)]
    comp = m.groups[1]
    assert comp["x1"] - comp["x0"] == fig.FEW_PX and comp["x0"] <= comp["label_x"] <= comp["x1"]


def _header_spans(groups) -> list[tuple[float, float, dict]]:
    """Each labelled group header's left and right end (px at HEADER_CHAR a character) and its group."""
    return [(g["label_x"] - fig.HEADER_CHAR * len(g["label"]) / 2, g["label_x"] + fig.HEADER_CHAR * len(g["label"]) / 2,
             g) for g in groups if g["label"]]


def test_close_group_headers_have_a_line_between_them(cap):
    """Headers a few px apart read as one phrase ("comp sink", "compressed 4:1 (80 rows) sink"): two that close get
    HEADER_SEP px and a thin line in the middle of their gap, in the static image (and on the canvas, at its font's
    width: tests/test_browser.py); a compressed group of one row keeps its "comp" header, the line in the narrower
    gap left."""
    view = AttentionView(cap, layer=2, head=0)
    sess = cap.session.model.session(ctx=512, prefill_chunk=64)
    with sess.capture(["attn.scores"], layers=[3], heads=[0]) as one:
        sess.prefill(cap.session.tokens[:200]).run(progress=False)
    for layer, source in ((2, view), (3, view), ("one row", AttentionView(one))):
        if layer == 3:
            view.show(3, 0)
        m = source.model
        assert [g["label"] for g in m.groups][1:] == (["comp", "sink"] if layer != 2 else
                                                      ["compressed 4:1 (80 rows)", "sink"]), layer
        (_, comp_end, _), (sink_start, _, _) = _header_spans(m.groups)[1:]
        assert sink_start - comp_end >= (fig.HEADER_SEP if layer != "one row" else fig.HEADER_MIN), layer
        assert [g["sep"] for g in m.groups] == [False, True, False]  # the raw window's header: far from the next
        # in the static image: one column, in the middle (within a glyph's blank columns) of the ink around it
        img = draw_static(source._state())
        (x,) = fig.separators(m.groups, ADVANCE)
        header = img[18 : 18 + 7, LEFT : LEFT + WIDTH]
        ink = np.nonzero((header < 100).all(axis=2).any(axis=0))[0]
        assert (img[fig.SEP_Y[0] : fig.SEP_Y[1], LEFT + round(x)] == fig.FAINT).all(), layer
        left, right = ink[ink < round(x)].max(), ink[ink > round(x)].min()
        assert right - left >= 4 and abs((round(x) - left) - (right - round(x))) <= 3, (layer, left, x, right)
    assert m.geometry["sep_y"] == list(fig.SEP_Y)  # where the canvas draws it


def test_a_layer_switch_keeps_the_zoom(cap):
    """The zoom a reader set survives a change of layer: the same queries and raw keys; compressed rows by their own
    groups of tokens (ratio 4's rows 10–30, tokens 40–123, are ratio 128's row 0; not widened by the window a
    ratio-4 row also pools); nothing left of it but the sink: the whole map. Each layer's region is carried from the
    one the zoom was made on, so coming back to that layer shows the zoom as made."""
    view = AttentionView(cap, layer=2, head=0)
    view.zoom((100, 140), (90, 150))
    view.layer_select.value = 3  # the dropdown, as a reader changes it
    assert view.region == (100, 140, 90, 150) and "zoomed: queries 100–139, columns 90–149 of 323" in view.model.note
    assert not view.reset_button.disabled
    np.testing.assert_array_equal(view.values, cap.attention(3).weights[100:140, 0, 90:150])
    view.show(2, 1)
    assert view.region == (100, 140, 90, 150)
    nr = cap.attention(2).n_raw
    view.zoom((100, 140), (nr + 10, nr + 31))
    view.show(3, 1)
    assert view.region == (100, 140, nr, nr + 1) and view.model.col_labels == ["compressed row 0 (tokens 0–127)"]
    # the note says where the region came from (21 compressed rows became one: a reader took it for a loss)
    assert "(layer 2's zoom: its queries, the keys of the tokens it showed)" in view.model.note
    view.show(2, 1)
    assert view.region == (100, 140, nr + 10, nr + 31)  # back where it was made: the zoom as made, not widened
    assert "layer 2's zoom" not in view.model.note
    view.show(3, 1)
    assert view.region == (100, 140, nr, nr + 1)  # and row 0 again, however often the layer changes
    view.show(2, 1)
    view.zoom((280, 320), (300, 401))  # raw 300–319 | compressed | sink: clamped to layer 3's 2 compressed rows
    view.show(3, 1)
    assert view.region == (280, 320, 300, 323)
    assert [(g["name"], g["stop"] - g["start"]) for g in view.model.groups] == [("raw", 20), ("comp", 2), ("sink", 1)]
    assert not any(g["label"].endswith("none seen") for g in view.model.groups)
    # raw keys after every query of the zoom: the header says none is seen (a walk-through took the grey for a bug)
    view.zoom((200, 240), (290, 300))
    assert [g["label"] for g in view.model.groups] == ["raw keys 290–299 (10) · none seen"]
    # a layer without compressed rows: a zoom on them alone leaves nothing, so the whole map
    model = cap.session.model
    sess = model.session(ctx=256, prefill_chunk=64)
    with sess.capture(["attn.scores"], layers=[0, 2], heads=[0]) as c:
        sess.prefill(cap.session.tokens[:64]).run(progress=False)
    other = AttentionView(c, layer=2)
    n = c.attention(2).n_raw
    other.zoom((10, 60), (n + 2, n + 8))
    other.show(0, 0)
    assert other.region is None and "zoomed" not in other.model.note and other.reset_button.disabled
    other.show(2, 0)
    assert other.region == (10, 60, n + 2, n + 8)  # back: the zoom as made (carried from layer 0's, it was lost)
    other.zoom((10, 60), (n + 2, n + c.attention(2).n_comp + 1))  # compressed rows and the sink: not the sink alone
    other.show(0, 0)
    assert other.region is None
    other.show(2, 0)
    other.zoom((10, 60), (n + c.attention(2).n_comp, n + c.attention(2).n_comp + 1))  # the sink alone stays so
    other.show(0, 0)
    assert other.region == (10, 60, c.attention(0).n_raw, c.attention(0).n_raw + 1)


def test_the_mass_key_names_only_the_groups_a_layer_has():
    """Layer 0 has no compressed rows: its legend keys the mass bars' raw window and sink, not "compressed" (the
    walk-through read a green key with nothing green above it); layer 2 keys all three."""
    model = ds4lab.load(backend="numpy")
    sess = model.session(ctx=256, prefill_chunk=64)
    with sess.capture(["attn.scores"], layers=[0, 2], heads=[0]) as c:
        sess.prefill(model.tokenizer.encode(TEXT.read_text(encoding="utf-8")[:1000])[:64]).run(progress=False)
    for layer, keyed in ((0, False), (2, True)):
        img = draw_static(AttentionView(c, layer=layer)._state())
        legend = img[-40:]  # the legend's line at the figure's foot
        assert (legend == fig.GROUP_COLOURS["comp"]).all(axis=2).any() == keyed, layer
        assert (legend == fig.GROUP_COLOURS["sink"]).all(axis=2).any()


def test_static_fallback_is_legible(cap):
    view = AttentionView(cap, layer=2, head=0, scale="row")
    html = view.static_html()
    png = view._repr_png_()
    w, h = struct.unpack(">II", png[16:24])
    assert (w, h) == (FIG_W, draw_static(view._state()).shape[0]) and w >= 480
    assert f"width='{FIG_W}'" in html and "max-pooled ×2 queries and ×2 keys" in html
    img = draw_static(view._state())
    dark = (img < 100).all(axis=2)
    for y, text in view.model.yticks:  # every query-axis label written left of the heatmap (≥ 5 px per digit)
        band = dark[TOP + int(y) - 3 : TOP + int(y) + 4, : LEFT - 5]
        assert band.sum() >= 5 * len(text), (y, text)
    assert len(view.model.yticks) >= 20


def test_the_pixel_fonts_letters_read_as_letters():
    """The static figure's font: g, j, p, q and y reach under the line (drawn on it they read as 9, P, 9 and the
    like: "wei9ht", "9uery"), no other character does; each character its own glyph; what it lacks drawn as '?'."""
    under = {c for c, glyph in GLYPHS.items() if glyph[7:].any()}
    assert under == set("gjpqy") and all(g.shape == (9, 5) for g in GLYPHS.values())
    assert len({g.tobytes() for g in GLYPHS.values()}) == len(GLYPHS)
    assert (text_mask("G") == text_mask("g")).all() and (text_mask("€") == text_mask("?")).all()
    assert not (text_mask("'\\n'") == text_mask("'?n'")).all()  # a newline token's label


def test_one_map_and_bad_input(cap):
    single = AttentionView(cap.attention(3), scale="log")  # an AttentionMap alone: no tokens, one layer
    assert single.layers == [3] and (single.model.rows, single.model.cols) == (160, 160 + 2 + 1)  # comp unpooled
    assert single.model.row_labels[0] == "queries 0–1" and "log" in single.model.scale_text
    with pytest.raises(ValueError, match="'sqrt'"):
        AttentionView(cap, scale="sqrt")
    with pytest.raises(ValueError, match="layer 5"):
        AttentionView(cap, layer=5)
    with pytest.raises(ValueError, match="head 7"):
        single.weights(head=7)
    with pytest.raises(TypeError, match="Capture"):
        AttentionView(np.zeros((3, 3)))


def _hex(rgb) -> str:
    return "#" + "".join(f"{int(c):02x}" for c in rgb)


def test_the_indexer_rows_look_alike_in_the_mask_and_the_attention_view(cap):
    """Dropped by the indexer and not yet compressed: one colour each, the same in both views (a kept row is drawn
    by its weight in the AttentionView, as every cell it attends); at full resolution each compressed cell of weight
    0 is marked by why, from the map's candidates and selection."""
    from ds4lab.visibility import DROPPED, NOT_YET
    from ds4lab.viz.mask_view import COLOURS

    assert COLOURS[DROPPED] == _hex(fig.DROPPED) and COLOURS[NOT_YET] == _hex(fig.NOT_YET)
    assert [text for _, text in fig.ZERO_KEY] == ["weight 0 (masked)", "not yet compressed", "dropped by the indexer"]
    # the static figure keys only the kinds it shows, as the canvas does: layer 3 has no indexer, so no salmon key
    legend = lambda layer: draw_static(AttentionView(cap, layer=layer, head=0)._state())[fig.geometry()["legend_y"]:]  # noqa: E731
    has = lambda img, rgb: bool((img == rgb).all(axis=2).any())  # noqa: E731
    assert has(legend(2), fig.DROPPED) and not has(legend(3), fig.DROPPED) and has(legend(3), fig.MASKED)
    view = AttentionView(cap, layer=2, head=0)
    amap = cap.attention(2)
    nr, nc = amap.n_raw, amap.n_comp
    view.zoom(queries=(0, 160), keys=(nr, nr + nc))  # the compressed rows of 160 queries: every cell
    m = view.model
    marks = np.frombuffer(m.marks, np.uint8).reshape(m.rows, m.cols)
    cand, sel = amap.candidates[:160], amap.selected[:160]
    assert marks.shape == cand.shape == (160, nc) and "every cell shown" in m.note
    np.testing.assert_array_equal(marks == fig.MARK_NOT_YET, ~cand)
    np.testing.assert_array_equal(marks == fig.MARK_DROPPED, cand & ~sel)
    assert (cand & ~sel).any() and (marks[cand & sel] == 0).all()  # kept rows: drawn by their weight
    img = draw_static(view._state())  # the static figure paints them so, and its legend names them
    for colour, mark in ((fig.NOT_YET, fig.MARK_NOT_YET), (fig.DROPPED, fig.MARK_DROPPED)):
        assert (img == colour).all(axis=2).sum() >= (marks == mark).sum() * 2  # a cell is ≥ 2 × 3 px


def test_the_views_place_their_tooltips_with_one_function():
    """AttentionView's tooltip beside the pointer (styled, at once, kept inside its frame: placeTip) is KVCacheView's,
    TierView's, ExpertView's, MaskView's and PrefillView's too, in place of native titles or a caption far from the
    pointer: one function in widgets/hovertip.js, which each of the six models puts before its own ESM, and no view
    defines again."""
    from ds4lab.viz.attention_view import AttentionModel
    from ds4lab.viz.experts import ExpertModel
    from ds4lab.viz.kv_view import KVCacheModel
    from ds4lab.viz.mask_view import MaskModel
    from ds4lab.viz.prefill_view import PrefillModel
    from ds4lab.viz.tier_view import TierModel

    shared = (WIDGETS / "hovertip.js").read_text(encoding="utf-8")
    assert "function placeTip(" in shared and "function pointerTip(" in shared
    for model, f in ((AttentionModel, "attention.js"), (KVCacheModel, "kvcache.js"), (TierModel, "tiers.js"),
                     (ExpertModel, "experts.js"), (MaskModel, "mask.js"), (PrefillModel, "prefill.js")):
        own, esm = (WIDGETS / f).read_text(encoding="utf-8"), model()._esm
        assert esm.startswith(shared) and esm.endswith(own) and esm.count("function placeTip(") == 1, f
        assert "function placeTip(" not in own and "function pointerTip(" not in own, f
    for f in ("kvcache.js", "tiers.js", "experts.js", "mask.js", "prefill.js"):
        src = (WIDGETS / f).read_text(encoding="utf-8")
        assert "title=" not in src and "<title>" not in src and "pointerTip(el" in src, f
    for f in ("kvcache.js", "tiers.js", "prefill.js"):  # their texts as data-tip (the others' made on hover)
        assert "data-tip=" in (WIDGETS / f).read_text(encoding="utf-8"), f


def test_the_views_share_their_text_helpers():
    """esc and plural are defined once (widgets/text.js) and put before each ESM that calls them: a view's own count
    of compressed rows read "1 compressed rows" (a walk-through) where its own copy of plural did not exist."""
    from ds4lab.viz.attention_view import AttentionModel
    from ds4lab.viz.experts import ExpertModel
    from ds4lab.viz.generation import GenerationModel
    from ds4lab.viz.kv_view import KVCacheModel
    from ds4lab.viz.mask_view import MaskModel
    from ds4lab.viz.prefill_view import PrefillModel
    from ds4lab.viz.tier_view import TierModel

    shared = (WIDGETS / "text.js").read_text(encoding="utf-8")
    models = {"generation.js": GenerationModel, "kvcache.js": KVCacheModel, "mask.js": MaskModel,
              "prefill.js": PrefillModel, "tiers.js": TierModel, "attention.js": AttentionModel,
              "experts.js": ExpertModel}
    assert set(models) == {f.name for f in WIDGETS.glob("*.js")} - {"hovertip.js", "text.js", "reserve.js"}
    for name, model in models.items():  # each ESM that calls them has them once, before its own code
        uses = re.search(r"\b(esc|plural)\(", (WIDGETS / name).read_text(encoding="utf-8"))
        assert model()._esm.count(shared) == (1 if uses else 0), name
    for f in WIDGETS.glob("*.js"):
        src = f.read_text(encoding="utf-8")
        assert f.name == "text.js" or ("const esc =" not in src and "const plural =" not in src), f.name
        assert not re.search(r"\$\{[^}]*\} (compressed|visible|indexer) rows", src), f.name


def test_each_key_group_is_drawn_on_its_own_ramp(cap):
    """A teacher's walk-through saw compressed rows' weights in blue under the green "compressed" header: a cell's
    ramp is its key group's now (white -> blue -> navy raw, white -> green -> dark green compressed), in the static
    figure, the thumbnails and the front-end (which writes reduce.RAMPS' stops), and the colour bar shows both."""
    from ds4lab.viz.attention_view import THUMB_COLS
    from ds4lab.viz.reduce import RAMPS, colormap, pool_factor

    view = AttentionView(cap, layer=2, head=0)
    state = view._state()
    img = draw_static(state)
    ramp = {g: {tuple(c) for c in colormap(np.arange(256, dtype=np.uint8), g)} for g in RAMPS}
    marks = {fig.MASKED, fig.NOT_YET, fig.DROPPED, (255, 255, 255)}
    for grp in state["groups"]:
        cells = {tuple(c) for c in img[TOP + 1 : TOP + fig.HEIGHT - 1, LEFT + grp["x0"] + 1 : LEFT + grp["x1"] - 1]
                 .reshape(-1, 3)} - marks
        assert cells and cells <= ramp[grp["name"]], grp["name"]
    ly = fig.geometry()["legend_y"] + 4  # the colour bar: raw above, compressed below, a white gap between them
    assert tuple(img[ly + 3, LEFT + 128]) in ramp["raw"] and tuple(img[ly + 13, LEFT + 128]) in ramp["comp"]
    assert tuple(img[ly + 8, LEFT + 128]) == (255, 255, 255)
    # each stripe named on its left, before the scale's "0" (touching, a student read them as one ramp): ink there
    # at each stripe's rows, none between them
    _, right = fig.stripe_name("raw", fig.ADVANCE, lambda t: fig.ADVANCE * len(t))
    names = (img[:, round(right) - 30 : round(right)] < 100).all(axis=2)
    assert names[ly : ly + 8].sum() > 10 and names[ly + 12 : ly + 20].sum() > 10 and not names[ly + 8 : ly + 12].any()
    # on a log scale the low end is long ("9.5e-05"): the names move left of it, "compressed" as "comp" (drawn over
    # each other, a walk-through could read neither); no column of ink holds both the low end's text and a name
    view.set_scale("log")
    state = view._state()
    lo = state["lo_text"]
    assert len(lo) >= 6, lo
    img = draw_static(state)
    ink = (img[ly : ly + fig.BAR_H] < 100).all(axis=2).any(axis=0)  # columns with text beside the bar
    lo_start = LEFT - 6 - ADVANCE * len(lo)
    text, right = fig.stripe_name("comp", ADVANCE * len(lo), lambda t: ADVANCE * len(t))
    assert text == "comp" and ink[round(right) - ADVANCE * 4 : round(right)].any() and ink[lo_start : LEFT - 6].any()
    assert not ink[round(right) : lo_start].any()  # a blank gap between the names and the low end
    comp = (img[ly + 12 : ly + fig.BAR_H] < 100).all(axis=2).any(axis=0)  # the compressed stripe's name: "comp"
    assert comp[round(right) - ADVANCE * 4 : round(right)].any() and not comp[: round(right) - ADVANCE * 4 - 1].any()
    view.set_scale("row")
    for layer in (2, 3):  # layer 3: 320 raw keys, 2 compressed rows and the sink, columns pooled by more than 3
        view.show(layer, 0)
        amap = cap.attention(layer)
        shape, thumbs = view.model.thumb_shape, np.frombuffer(view.model.thumbs, np.uint8)
        first = thumbs[: shape[0] * shape[1] * 3].reshape(shape[0], shape[1], 3)
        n_comp = -(-amap.n_comp // pool_factor(amap.weights.shape[2], THUMB_COLS))  # its pooled columns
        for cols, g in ((slice(0, 1), "raw"), (slice(-1 - n_comp, -1), "comp"), (slice(-1, None), "sink")):
            assert {tuple(c) for c in first[:, cols].reshape(-1, 3)} - marks <= ramp[g], (layer, g)
    view.show(2, 0)
    sink = cap.attention(2).weights.shape[2] - 1
    view.zoom(keys=(sink, sink + 1))  # the sink alone: its ramp in the colour bar
    img = draw_static(view._state())
    assert tuple(img[ly + 5, LEFT + 128]) in ramp["sink"] and tuple(img[ly + 5, LEFT + 128]) not in ramp["raw"]
    js = (Path(ds4lab.__file__).parent.parent / "widgets" / "attention.js").read_text()
    for g, stops in RAMPS.items():
        assert f"{g}: {[list(s) for s in stops]}" in js, g
