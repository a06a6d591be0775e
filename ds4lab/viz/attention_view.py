"""AttentionView: one layer and head of a captured attention map, keys in three groups (raw window | compressed
rows | sink), on a figure of fixed layout (front-end ``widgets/attention.js``, static PNG :mod:`.attention_figure`)
that the front-end draws at the output's width (down to 0.8 of its size; a narrower output scrolls it sideways).

Cells are scaled up to fill the figure and never drawn below ``MIN_CELL`` px: a map with more cells than fit is
max-pooled (the note says by how much), and zooming into a region re-reduces it from the full-resolution weights,
so a small enough region shows every cell. A few compressed rows (a ratio-128 layer's) are never pooled and keep
columns ``FEW_PX`` wide. Beside each query, its mass split into raw | compressed | sink; beside the
figure, small multiples of every captured head of the layer, in a column no taller than it (the figure shrinks for
them down to 0.8 of its size; a narrower output has them under it, in one row)."""

from __future__ import annotations

import html
import math

import ipywidgets as W
import numpy as np
import traitlets as t

from ..config import is_int
from ..text_table import layer_kind, plural
from .attention_figure import (
    FEW_COLS,
    FEW_PX,
    GAP,
    HEIGHT,
    LEFT,
    MARK_DROPPED,
    MARK_MASKED,
    MARK_NOT_YET,
    MASKED,
    MIN_CELL,
    SINK_PX,
    WIDTH,
    X_LABELS,
    draw_static,
    geometry,
    place_headers,
)
from .base import View, ViewModel, token_texts, widget_module
from .reduce import (
    SCALES,
    colormap,
    column_factor,
    edges,
    maxpool,
    png_base64,
    png_bytes,
    pool_factor,
    pool_groups,
    scale_colours,
)

GROUPS = ("raw", "comp", "sink")
THUMB_ROWS, THUMB_COLS = 60, 90  # cells of a head's small multiple at most
# the most characters of an axis label: the key positions' room under the heatmap (written bottom to top, to the
# colour bar 4 px below it) and the queries' left of it, at 6.6 px a character (11 px monospace)
X_LABEL_CHARS, Y_LABEL_CHARS = int((X_LABELS + 4 - 6) / 6.6), int((LEFT - 6) / 6.6)
TICK_PX = 13  # px between two axis labels at least: 10 px text, still apart in a view scaled to 0.85


class AttentionModel(ViewModel):
    _esm = widget_module("attention.js", "hovertip.js")
    title = t.Unicode("").tag(sync=True)
    note = t.Unicode("").tag(sync=True)
    layer = t.Int(0).tag(sync=True)
    head = t.Int(0).tag(sync=True)
    rows = t.Int(0).tag(sync=True)
    cols = t.Int(0).tag(sync=True)
    buf = t.Bytes(b"").tag(sync=True)  # uint8 [rows, cols]: colour index on the scale
    values = t.Bytes(b"").tag(sync=True)  # float32 [rows, cols]: the weight (max of the pooled cells), for tooltips
    marks = t.Bytes(b"").tag(sync=True)  # uint8 [rows, cols] of weight 0: MARK_MASKED, MARK_NOT_YET, MARK_DROPPED
    geometry = t.Dict().tag(sync=True)
    row_edges = t.List().tag(sync=True)  # px [rows + 1] from the heatmap's top
    col_edges = t.List().tag(sync=True)  # px [[x0, x1]] per column from the heatmap's left (groups apart)
    groups = t.List().tag(sync=True)  # [{name, label, start, stop (columns), x0, x1 (px)}]
    xticks = t.List().tag(sync=True)  # [[x px, text]]
    yticks = t.List().tag(sync=True)  # [[y px, text]]
    y_title = t.Unicode("").tag(sync=True)
    row_labels = t.List(t.Unicode()).tag(sync=True)
    col_labels = t.List(t.Unicode()).tag(sync=True)
    mass = t.List().tag(sync=True)  # [[raw, comp, sink]] per row: mean over its queries
    scale = t.Unicode("row").tag(sync=True)
    lo_text = t.Unicode("").tag(sync=True)
    hi_text = t.Unicode("").tag(sync=True)
    scale_text = t.Unicode("").tag(sync=True)
    thumbs = t.Bytes(b"").tag(sync=True)  # RGB uint8 [heads, thumb rows, thumb cols, 3]: each head on the scale
    thumb_shape = t.List().tag(sync=True)
    thumb_heads = t.List().tag(sync=True)
    # from the front-end: a dragged region [r0, r1, c0, c1] of shown cells (inclusive), [-1] to reset; a head clicked
    zoom_request = t.List().tag(sync=True)
    pick_head = t.Int(-1).tag(sync=True)


def _pool_spans(start: int, stop: int, f: int) -> list[tuple[int, int]]:
    return [(a, min(a + f, stop)) for a in range(start, stop, f)]


def _key_spans(amap) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per key column of ``amap``: its group (0 raw, 1 compressed, 2 sink) and the first and last token it stands for
    (a raw key its position, a compressed row c its own group of tokens cR … cR + R − 1, not the window before that a
    ratio-4 row also pools: matched by windows, a zoom widened at every change of layer; the sink after every
    token)."""
    R, rows = amap.ratio, np.asarray(amap.comp_rows, dtype=np.int64)
    end = np.iinfo(np.int64).max
    group = np.repeat([0, 1, 2], [amap.n_raw, amap.n_comp, 1])
    return (group, np.concatenate([amap.raw_positions, rows * R, [end]]),
            np.concatenate([amap.raw_positions, rows * R + R - 1, [end]]))


def carry_region(old, new, region):
    """A zoomed ``region`` (a, b, c, d) of layer map ``old`` on layer map ``new``: the same query positions, and keys
    from the first shown group's first token to the last shown group's last one (raw keys by position, compressed
    rows by their own groups of tokens: a ratio-4 layer's rows 10–30 become the ratio-128 row 0, and its row 0 the
    ratio-4 rows 0–31), clamped to ``new``'s; None where nothing of it is left but the sink (a zoom that held more),
    or it is all of ``new``."""
    a, b, c, d = region
    qa, qb = np.searchsorted(new.queries, old.queries[a]), np.searchsorted(new.queries, old.queries[b - 1], "right")
    (og, olo, ohi), (ng, nlo, nhi) = _key_spans(old), _key_spans(new)
    first = np.nonzero((ng > og[c]) | ((ng == og[c]) & (nhi >= olo[c])))[0]
    last = np.nonzero((ng < og[d - 1]) | ((ng == og[d - 1]) & (nlo <= ohi[d - 1])))[0]
    if qa >= qb or not len(first) or not len(last) or first[0] > last[-1]:
        return None
    out = (int(qa), int(qb), int(first[0]), int(last[-1]) + 1)
    sink_only = out[2] == len(ng) - 1 and og[c] != 2
    return None if sink_only or out == (0, len(new.queries), 0, len(ng)) else out


class AttentionView(View):
    """Heatmap of one layer and head of a :class:`ds4lab.hooks.Capture` (or an ``AttentionMap``): queries down,
    keys across in three groups (raw window | compressed rows | sink), on a ``scale`` of ``SCALES`` ("linear",
    "row": each query over its max, "log"). ``zoom(queries=(a, b), keys=(c, d))`` shows a region of the map's
    rows and columns (half-open indices), ``reset_zoom()`` the whole map. ``head`` is a head's number, as
    ``show`` and ``weights`` take it (None: the first captured)."""

    def __init__(self, source, layer: int | None = None, head: int | None = None, scale: str = "row",
                 tokens=None):
        from ..hooks import AttentionMap, Capture

        if isinstance(source, Capture):
            self._maps, self._capture = {}, source
            self.layers = sorted({int(n.split(".")[1]) for n in source.names if n.endswith(".attn.scores")})
            tok = source.session.model.tokenizer
            self.tokens = token_texts(tok, source.session.tokens) if tokens is None else tokens
        elif isinstance(source, AttentionMap):
            self._maps, self._capture, self.layers = {source.layer: source}, None, [source.layer]
            self.tokens = tokens
        else:
            raise TypeError(f"AttentionView takes a Capture (with attn.scores) or an AttentionMap, not {type(source)}")
        if not self.layers:
            raise ValueError("the capture holds no attention maps: capture 'attn.scores'")
        self.layer = self.layers[0] if layer is None else self._captured_layer(layer)
        if scale not in SCALES:
            raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
        self.scale, self.region = scale, None
        # (layer, region) of the last zoom as made: each layer shown gets it carried from there, so a round trip
        # through other layers (a raw-only one holds no compressed column) comes back to the same region
        self._zoom_origin: tuple[int, tuple] | None = None
        self._thumb_cache, self._mass_cache = {}, {}  # by (layer, scale), (layer, head): what a switch back reuses
        self.model = AttentionModel()
        amap = self.map(self.layer)
        head = int(amap.heads[0]) if head is None else self._captured_head(amap, head)
        narrow = dict(layout=W.Layout(width="130px"), style={"description_width": "40px"})
        self.layer_select = W.Dropdown(options=self.layers, value=self.layer, description="layer", **narrow)
        self.head_select = W.Dropdown(options=[int(h) for h in amap.heads], description="head", value=head,
                                      **narrow)
        self.scale_select = W.ToggleButtons(options=[("linear", "linear"), ("per row", "row"), ("log", "log")],
                                            value=scale, style={"button_width": "76px"},
                                            tooltips=["colour: weight / max", "colour: weight / the query's max",
                                                      "colour: log10 weight, 4 decades"])
        self.reset_button = W.Button(description="reset zoom", disabled=True, layout=W.Layout(width="100px"))
        self.head = self.head_select.value
        self._syncing = False  # True while show() sets the controls: their observers then do nothing
        on = self.guarded  # an error of a switch shows in the view
        self.layer_select.observe(on(lambda ch: self._syncing or self.show(ch["new"])), names="value")
        self.head_select.observe(on(lambda ch: self._syncing or self.show(self.layer, ch["new"])), names="value")
        self.scale_select.observe(on(lambda ch: self._syncing or self.set_scale(ch["new"])), names="value")
        self.reset_button.on_click(on(lambda _: self.reset_zoom()))
        self.model.observe(on(self._on_zoom_request), names="zoom_request")
        self.model.observe(on(self._on_pick_head), names="pick_head")
        controls = W.HBox([self.layer_select, self.head_select, self.scale_select, self.reset_button],
                          layout=W.Layout(flex_flow="row wrap"))  # on a narrow output: two lines, none cut off
        self.widget = W.VBox([controls, self.model])
        self.show(self.layer, self.head)

    def __repr__(self) -> str:
        m = self.model
        return f"AttentionView(layer {self.layer}, head {self.head}: {m.rows}×{m.cols} cells; {m.note})"

    # the data
    def map(self, layer: int):
        if layer not in self._maps:
            self._maps[layer] = self._capture.attention(layer)
        return self._maps[layer]

    def weights(self, layer: int | None = None, head: int | None = None) -> np.ndarray:
        """The full-resolution weights ``[queries, keys]`` of one head (default: the one shown)."""
        amap = self.map(self.layer if layer is None else layer)
        head = self._captured_head(amap, self.head if head is None else head)
        return amap.weights[:, int(np.nonzero(amap.heads == head)[0][0]), :]

    def _captured_layer(self, layer) -> int:
        """``layer`` as an int, refused (naming the layers there are) unless the capture holds it."""
        if not is_int(layer):
            raise TypeError(f"layer must be a layer number, got {layer!r}")
        if layer not in self.layers:
            raise ValueError(f"layer {layer} was not captured (layers {self.layers})")
        return int(layer)

    @staticmethod
    def _captured_head(amap, head) -> int:
        """``head`` as an int, refused (naming the heads there are) unless the map holds it."""
        if not is_int(head):
            raise TypeError(f"head must be a head's number, got {head!r}")
        if head not in amap.heads:
            raise ValueError(f"head {head} was not captured in layer {amap.layer} (heads "
                             f"{[int(h) for h in amap.heads]})")
        return int(head)

    def mass_split(self, layer: int | None = None, head: int | None = None) -> np.ndarray:
        """Each query's attention mass on the raw window, the compressed rows and the sink: ``[queries, 3]``."""
        amap = self.map(self.layer if layer is None else layer)
        w = self.weights(layer, head)
        return np.stack([w[:, amap.groups[g]].sum(axis=1) for g in GROUPS], axis=1)

    def _label(self, p: int, chars: int, width: int) -> str:
        """Position ``p`` and up to ``width`` characters of its token, in ``chars`` characters at most (a longer
        position leaves its token less room, none under two characters: a label ran into the colour bar)."""
        for w in range(min(width, chars - len(str(p)) - 3), 1, -1):  # 3: a space and the quotes
            label = f"{p}{self._tok(p, w)}"
            if len(label) <= chars:  # (an escaped character takes more than one)
                return label
        return str(p)

    def _tok(self, p: int, width: int | None = None) -> str:
        if self.tokens is None or not 0 <= p < len(self.tokens):
            return ""
        text = self.tokens[p] if width is None else self.tokens[p][:width]
        return " " + repr(text)

    # what is shown
    def show(self, layer: int, head: int | None = None) -> None:
        """Show ``layer`` and ``head`` (None: the head shown, or the layer's first where it was not captured); a
        new layer keeps the zoom on the same queries and keys where it has them (:func:`carry_region`, from the
        layer the zoom was made on)."""
        layer = self._captured_layer(layer)
        amap = self.map(layer)
        if head is None:
            head = self.head if self.head in amap.heads else int(amap.heads[0])
        head = self._captured_head(amap, head)
        if layer != self.layer and self._zoom_origin is not None:
            at, region = self._zoom_origin
            self.region = region if layer == at else carry_region(self.map(at), amap, region)
        self.layer, self.head = layer, head
        self._syncing = True
        try:
            self.layer_select.value = layer
            opts = [int(h) for h in amap.heads]
            if list(self.head_select.options) != opts:
                self.head_select.options = opts
            self.head_select.value = head
        finally:
            self._syncing = False
        self._draw()

    def set_scale(self, scale: str) -> None:
        if scale not in SCALES:
            raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
        self.scale = scale
        self._syncing = True
        try:
            self.scale_select.value = scale
        finally:
            self._syncing = False
        self._draw()

    def zoom(self, queries: tuple[int, int] | None = None, keys: tuple[int, int] | None = None) -> None:
        """Show the map's rows ``queries = (a, b)`` and columns ``keys = (c, d)`` (half-open indices into
        ``AttentionMap.weights``; None: all), re-reduced from the full-resolution weights."""
        Q, K = self.weights().shape
        for name, pair in (("queries", queries), ("keys", keys)):
            if pair is not None and not (isinstance(pair, (tuple, list)) and len(pair) == 2
                                         and all(is_int(i) for i in pair)):
                raise TypeError(f"zoom: {name} is a pair of indices (start, end), got {pair!r}")
        (a, b), (c, d) = queries or (0, Q), keys or (0, K)
        if not (0 <= a < b <= Q and 0 <= c < d <= K):
            raise ValueError(f"zoom region queries {queries}, keys {keys} is not inside the map's {Q} × {K}")
        self.region = None if (a, b, c, d) == (0, Q, 0, K) else (a, b, c, d)
        self._zoom_origin = None if self.region is None else (self.layer, self.region)
        self._draw()

    def reset_zoom(self) -> None:
        self.region = self._zoom_origin = None
        self._draw()

    def _on_zoom_request(self, change) -> None:
        req = change["new"]
        if not req:
            return
        self.model.zoom_request = []
        if req == [-1]:
            self.reset_zoom()
            return
        r0, r1, c0, c1 = (int(v) for v in req)
        rows, cols = self._row_src, self._col_src
        if not (0 <= r0 <= r1 < len(rows) and 0 <= c0 <= c1 < len(cols)):
            return  # a request about a figure already replaced
        self.zoom((rows[r0][0], rows[r1][1]), (cols[c0][0], cols[c1][1]))

    def _on_pick_head(self, change) -> None:
        if change["new"] >= 0:
            self.model.pick_head = -1
            self.show(self.layer, change["new"])

    def _draw(self) -> None:
        amap, w = self.map(self.layer), self.weights()
        Q, K = w.shape
        a, b, c, d = self.region or (0, Q, 0, K)
        bounds = {"raw": (0, amap.n_raw), "comp": (amap.n_raw, amap.n_raw + amap.n_comp), "sink": (K - 1, K)}
        present = [(g, max(lo, c), min(hi, d)) for g, (lo, hi) in bounds.items() if max(lo, c) < min(hi, d)]
        # columns: the sink keeps SINK_PX, a compressed group of few rows keeps each row at FEW_PX or more (as wide
        # as the others where they are wider); the other groups share the rest, pooled by one factor, GAP apart
        widths = [hi - lo for _, lo, hi in present]
        few = [g == "comp" and n <= FEW_COLS for (g, _, _), n in zip(present, widths)]
        pooled = [g != "sink" and not f for (g, _, _), f in zip(present, few)]
        n_few, alone = sum(n for n, f in zip(widths, few) if f), len(present) == 1
        avail = WIDTH - GAP * (len(present) - 1) - (SINK_PX if present[-1][0] == "sink" and not alone else 0)
        slots = (avail - n_few * FEW_PX) // MIN_CELL
        fc = column_factor([n for n, p in zip(widths, pooled) if p], slots) if any(pooled) else 1
        fcs = [fc if p else 1 for p in pooled]
        fr = pool_factor(b - a, HEIGHT // MIN_CELL)
        red, spans = pool_groups(w[a:b, c:d], widths, fr, fc, pooled)
        n_pooled = sum(e - s for (s, e), p in zip(spans, pooled) if p)
        few_px = max(FEW_PX, avail / (n_pooled + n_few)) if n_few else 0
        xe = edges(n_pooled, avail - round(n_few * few_px))
        col_edges, groups, x, k = [], [], 0, 0
        for (g, lo, hi), (s, e), f in zip(present, spans, few):
            n = e - s
            if g == "sink":
                xs = [0, WIDTH] if alone else [WIDTH - SINK_PX, WIDTH]
            elif f:
                xs = edges(n, round(n * few_px), x)
            else:
                xs, k = x + xe[k : k + n + 1] - xe[k], k + n
            col_edges += [[int(xs[i]), int(xs[i + 1])] for i in range(n)]
            x0, x1 = int(xs[0]), int(xs[-1])
            x = x1 + GAP
            # a zoom kept across layers can hold keys no query of it sees (raw keys after them all): the header says
            # so, where the map alone looks broken
            unseen = g != "sink" and not w[a:b, lo:hi].any()
            label = self._group_label(amap, g, lo, hi) + (" · none seen" if unseen else "")
            groups.append(dict(name=g, start=s, stop=e, x0=x0, x1=x1, label=label))
        place_headers(groups)
        row_src = _pool_spans(a, b, fr)
        col_src = [sp for (_, lo, hi), f in zip(present, fcs) for sp in _pool_spans(lo, hi, f)]
        self._row_src, self._col_src, self.values = row_src, col_src, red
        ye = edges(len(row_src), HEIGHT)
        starts = np.array([s for s, _ in row_src])  # each shown row's first query
        # colours and marks: weight exactly 0 is masked; in the compressed group, a row the indexer dropped and a
        # row not formed yet for the query are marked so (a pooled cell: dropped if any of its cells is)
        # per row: over the query's whole row, not the zoomed columns (the legend's "the query's max")
        row_max = np.maximum.reduceat(w[a:b].max(axis=1), starts - a)
        idx, lo_v, hi_v = scale_colours(red, self.scale, row_max=row_max)
        marks = np.where(red == 0, MARK_MASKED, 0).astype(np.uint8)
        hidden = 0  # pooled cells that show a weight and hold a row the indexer dropped for one of their queries
        for (g, lo, hi), (s, e), f in zip(present, spans, fcs):
            if g == "comp":  # pooled like the weights
                rows_cols = (slice(a, b), slice(lo - amap.n_raw, hi - amap.n_raw))
                cand = amap.candidates[rows_cols]
                left_out = cand & ~amap.selected[rows_cols]
                zero = red[:, s:e] == 0
                not_yet = (maxpool((~cand).astype(np.float64), fr, f) > 0) & zero
                any_dropped = maxpool(left_out.astype(np.float64), fr, f) > 0
                dropped, hidden = any_dropped & zero, int((any_dropped & ~zero).sum())
                marks[:, s:e][not_yet] = MARK_NOT_YET
                marks[:, s:e][dropped] = MARK_DROPPED
        if (self.layer, self.head) not in self._mass_cache:
            self._mass_cache[self.layer, self.head] = self.mass_split()
        row_mass = (np.add.reduceat(self._mass_cache[self.layer, self.head][a:b], starts - a, axis=0)
                    / np.diff([*starts, b])[:, None]).tolist()
        m = self.model
        with m.hold_sync():
            m.title = (f"layer {self.layer} ({layer_kind(amap.ratio)}), head {self.head}: {Q} queries × "
                       f"{amap.n_raw} raw | {amap.n_comp} compressed | sink")
            m.note = self._note(amap, (a, b, c, d), (Q, K), red.shape, fr, fc, hidden)
            m.layer, m.head, m.scale = self.layer, self.head, self.scale
            m.geometry = geometry()
            m.rows, m.cols = red.shape
            m.row_edges, m.col_edges, m.groups = ye.tolist(), col_edges, groups
            m.xticks = self._xticks(amap, present, spans, col_src, col_edges)
            m.yticks = self._yticks(amap, row_src, ye, fr)
            m.y_title = "query position"
            m.row_labels = [self._query_label(amap, s, e) for s, e in row_src]
            win = amap.comp_windows
            m.col_labels = [self._key_label(amap, win, s, e) for s, e in col_src]
            m.mass = row_mass
            m.lo_text, m.hi_text, m.scale_text = self._scale_texts(lo_v, hi_v)
            self._thumbs()
            m.buf, m.values, m.marks = idx.tobytes(), red.astype(np.float32).tobytes(), marks.tobytes()
        self.reset_button.disabled = self.region is None

    def _thumbs(self) -> None:
        """Every captured head of the layer, whole, max-pooled to at most THUMB_ROWS × THUMB_COLS, on the scale."""
        amap = self.map(self.layer)
        heads = [int(h) for h in amap.heads]
        if (self.layer, self.scale) not in self._thumb_cache:
            Q, K = amap.weights.shape[0], amap.weights.shape[2]
            fr, fc = pool_factor(Q, THUMB_ROWS), pool_factor(K, THUMB_COLS)
            # each group pooled on its own, as the map is: a column's ramp is its group's (none mixes two)
            widths = [amap.n_raw, amap.n_comp, 1]
            pooled = [pool_groups(self.weights(self.layer, h), widths, fr, fc, [True, True, False]) for h in heads]
            small = [red for red, _ in pooled]
            names = np.repeat(["raw", "comp", "sink"], [e - s for s, e in pooled[0][1]])
            rgb = np.stack([colormap(scale_colours(s, self.scale)[0], names) for s in small])
            rgb[np.stack(small) == 0] = MASKED
            self._thumb_cache[self.layer, self.scale] = (list(rgb.shape[1:3]), rgb.tobytes())
        shape, thumbs = self._thumb_cache[self.layer, self.scale]
        self.model.thumb_shape, self.model.thumb_heads, self.model.thumbs = shape, heads, thumbs

    # the text
    def _group_label(self, amap, g, lo, hi) -> str:
        """The group's full header (attention_figure.place_headers shortens it where there is no room)."""
        n = hi - lo
        if g == "sink":
            return "sink"
        nr, whole = amap.n_raw, (lo, hi) in ((0, amap.n_raw), (amap.n_raw, amap.n_raw + amap.n_comp))
        if g == "raw":
            p = amap.raw_positions
            # every raw position some query saw: not "the window", which each query has of its own (64 here)
            return f"raw keys {p[lo]}–{p[hi - 1]} ({n})"
        if whole:  # "4:1": the compression ratio, not a pooling of the drawing
            return f"compressed {amap.ratio}:1 ({plural(n, 'row')})"
        return f"compressed rows {lo - nr}–{hi - 1 - nr}"

    def _query_label(self, amap, s, e) -> str:
        q = amap.queries
        return f"query {q[s]}{self._tok(int(q[s]))}" if e - s == 1 else f"queries {q[s]}–{q[e - 1]}"

    def _key_label(self, amap, win, s, e) -> str:
        nr, nc = amap.n_raw, amap.n_comp
        if s >= nr + nc:
            return "sink"
        if s >= nr:
            r0, r1 = s - nr, e - 1 - nr
            return (f"compressed row {r0} (tokens {win[r0][0]}–{win[r0][1]})" if r0 == r1
                    else f"compressed rows {r0}–{r1} (tokens {win[r0][0]}–{win[r1][1]})")
        p = amap.raw_positions
        return f"raw key {p[s]}{self._tok(int(p[s]))}" if e - s == 1 else f"raw keys {p[s]}–{p[e - 1]}"

    def _xticks(self, amap, present, spans, col_src, col_edges) -> list:
        ticks = []
        for (g, _, _), (col, stop) in zip(present, spans):
            n = stop - col
            if g == "sink":
                x0, x1 = col_edges[col]
                ticks.append([(x0 + x1) / 2, "sink"])
            else:
                px = (col_edges[col + n - 1][1] - col_edges[col][0]) / n
                step = max(1, math.ceil(TICK_PX / px))
                for j in range(0, n, step):
                    s, e = col_src[col + j]
                    x0, x1 = col_edges[col + j]
                    if g == "raw":
                        pos = int(amap.raw_positions[s])
                        text = self._label(pos, X_LABEL_CHARS, 6) if step == 1 and e - s == 1 else str(pos)
                    else:
                        text = f"c{s - amap.n_raw}"
                    ticks.append([(x0 + x1) / 2, text])
        return ticks

    def _yticks(self, amap, row_src, ye, fr) -> list:
        px = HEIGHT / len(row_src)
        step = max(1, math.ceil(TICK_PX / px))
        out = []
        for i in range(0, len(row_src), step):
            pos = int(amap.queries[row_src[i][0]])
            text = self._label(pos, Y_LABEL_CHARS, 8) if step == 1 and fr == 1 else str(pos)
            out.append([(int(ye[i]) + int(ye[i + 1])) / 2, text])
        return out

    def _scale_texts(self, lo, hi) -> tuple[str, str, str]:
        if self.scale == "linear":
            return "0", f"{hi:.3g}", "linear: weight"
        if self.scale == "row":
            return "0", "1", "per row: weight / the query's max"
        return f"{lo:.1e}", f"{hi:.3g}", "log: weight, 4 decades"

    def _note(self, amap, region, shape, shown, fr, fc, hidden: int = 0) -> str:
        a, b, c, d = region
        Q, K = shape
        text = f"{shown[0]}×{shown[1]} cells"
        if fr > 1 or fc > 1:
            pooled = " and ".join(f"×{f} {axis}" for f, axis in ((fr, "queries"), (fc, "keys")) if f > 1)
            # a pooled cell shows its largest weight: a row the indexer dropped for one of its queries is not salmon
            hides = f"; {hidden:,} pooled cells hide an indexer-dropped row under a weight" if hidden else ""
            text += f", max-pooled {pooled} (zoom in for every cell{hides})"
        else:
            text += ", every cell shown"
        if self.region is not None:
            text += f" · zoomed: queries {amap.queries[a]}–{amap.queries[b - 1]}, columns {c}–{d - 1} of {K}"
            if self._zoom_origin is not None and self._zoom_origin[0] != self.layer:  # a compressed row or two
                # where the zoom showed dozens: say why (carry_region)
                text += f" (layer {self._zoom_origin[0]}'s zoom: its queries, the keys of the tokens it showed)"
        return text + " · drag on the map to zoom, double-click to reset"

    # the static fallback
    def _state(self) -> dict:
        m = self.model
        return {k: getattr(m, k) for k in ("rows", "cols", "buf", "marks", "row_edges", "col_edges", "groups", "xticks",
                                           "yticks", "y_title", "mass", "lo_text", "hi_text", "scale_text")}

    def static_html(self) -> str:
        m = self.model
        g = geometry()
        return (
            f"<div class='ds4-view' style='font:12px monospace'><b>{html.escape(m.title)}</b><br>"
            f"<img alt='attention heatmap' width='{g['width']}' height='{g['height']}' "
            "style='max-width:100%;height:auto' "
            f"src='data:image/png;base64,{png_base64(draw_static(self._state()))}'/><br>"
            f"{html.escape(m.note.split(' · drag')[0])}</div>"
        )

    def _repr_png_(self):
        return png_bytes(draw_static(self._state()))
