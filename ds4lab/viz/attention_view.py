"""AttentionView: one layer and head of a captured attention map, keys in three groups (raw window | compressed
rows | sink), drawn on a canvas (front-end ``widgets/attention.js``)."""

from __future__ import annotations

import html

import ipywidgets as W
import numpy as np
import traitlets as t

from .base import View, ViewModel, token_texts, widget_file
from .reduce import MAX_SIDE, colormap, png_base64, reduce_groups, to_uint8


class AttentionModel(ViewModel):
    _esm = widget_file("attention.js")
    title = t.Unicode("").tag(sync=True)
    buf = t.Bytes(b"").tag(sync=True)  # uint8 [rows, cols], weight / vmax · 255, max-pooled
    marks = t.Bytes(b"").tag(sync=True)  # uint8 [rows, cols]: 1 dropped by the indexer, 2 selected
    rows = t.Int(0).tag(sync=True)
    cols = t.Int(0).tag(sync=True)
    row_factor = t.Int(1).tag(sync=True)
    col_factor = t.Int(1).tag(sync=True)
    vmax = t.Float(0.0).tag(sync=True)
    groups = t.List().tag(sync=True)
    row_labels = t.List(t.Unicode()).tag(sync=True)
    col_labels = t.List(t.Unicode()).tag(sync=True)


def _span_label(items, f, fmt) -> list[str]:
    return [fmt(items[i : i + f]) for i in range(0, len(items), f)]


class AttentionView(View):
    """Heatmap of one layer and head of a :class:`ds4lab.hooks.Capture` (or an ``AttentionMap``): queries
    down, keys across in three groups (raw window | compressed rows | sink); max-pooled to at most
    ``max_side`` × ``max_side`` and sent as a uint8 buffer."""

    def __init__(self, source, layer: int | None = None, head: int = 0, max_side: int = MAX_SIDE, tokens=None):
        from ..hooks import AttentionMap, Capture

        self.max_side = max_side
        if isinstance(source, Capture):
            self._maps = {}
            self._capture = source
            self.layers = sorted({int(n.split(".")[1]) for n in source.names if n.endswith(".attn.scores")})
            tok = source.session.model.tokenizer
            self.tokens = token_texts(tok, source.session.tokens) if tokens is None else tokens
        elif isinstance(source, AttentionMap):
            self._maps, self._capture, self.layers = {source.layer: source}, None, [source.layer]
            self.tokens = tokens
        else:
            raise TypeError("AttentionView takes a Capture (with attn.scores) or an AttentionMap")
        if not self.layers:
            raise ValueError("the capture holds no attention maps: capture 'attn.scores'")
        self.layer = self.layers[0] if layer is None else layer
        self.model = AttentionModel()
        amap = self.map(self.layer)
        self.layer_select = W.Dropdown(options=self.layers, value=self.layer, description="layer")
        self.head_select = W.Dropdown(
            options=[int(h) for h in amap.heads],
            value=int(amap.heads[head]) if head < len(amap.heads) else int(amap.heads[0]),
            description="head",
        )
        self.head = self.head_select.value
        self.layer_select.observe(self.guarded(lambda ch: self.show(ch["new"], self.head)), names="value")
        self.head_select.observe(self.guarded(lambda ch: self.show(self.layer, ch["new"])), names="value")
        self.widget = W.VBox([W.HBox([self.layer_select, self.head_select]), self.model])
        self.show(self.layer, self.head)

    def __repr__(self) -> str:
        m = self.model
        return (f"AttentionView(layer {self.layer}, head {self.head}: {m.rows}×{m.cols} cells, "
                f"pooled ×{m.row_factor}/×{m.col_factor})")

    def map(self, layer: int):
        if layer not in self._maps:
            self._maps[layer] = self._capture.attention(layer)
        return self._maps[layer]

    def _tok(self, p: int) -> str:
        if self.tokens is None or not 0 <= p < len(self.tokens):
            return ""
        return " " + repr(self.tokens[p])

    def reduced(self, layer: int, head: int):
        """(uint8 [rows, cols], marks [rows, cols], row factor, col factor, vmax, groups) for one head."""
        amap = self.map(layer)
        h = int(np.nonzero(amap.heads == head)[0][0])
        w = amap.weights[:, h, :]
        groups = [("raw", amap.n_raw), ("comp", amap.n_comp), ("sink", 1)]
        red, fr, fc, spans = reduce_groups(w, groups, self.max_side, self.max_side)
        img, vmax = to_uint8(red)
        mark = np.zeros(w.shape)
        mark[:, amap.groups["comp"]] = np.where(amap.selected, 2, np.where(amap.candidates, 1, 0))
        mred, _, _, _ = reduce_groups(mark, groups, self.max_side, self.max_side)
        return img, np.maximum(mred, 0).astype(np.uint8), fr, fc, vmax, spans

    def show(self, layer: int, head: int) -> None:
        amap = self.map(layer)
        if head not in amap.heads:
            head = int(amap.heads[0])
        self.layer, self.head = layer, head
        img, marks, fr, fc, vmax, spans = self.reduced(layer, head)
        qs = [int(q) for q in amap.queries]
        row_labels = _span_label(
            qs, fr, lambda b: f"query {b[0]}{self._tok(b[0])}" if len(b) == 1 else f"queries {b[0]}–{b[-1]}"
        )
        raw = [int(p) for p in amap.raw_positions]
        win = amap.comp_windows
        col_labels = (
            _span_label(raw, fc, lambda b: f"raw t{b[0]}{self._tok(b[0])}" if len(b) == 1 else f"raw t{b[0]}–t{b[-1]}")
            + _span_label(
                list(range(amap.n_comp)),
                fc,
                lambda b: (
                    f"comp row {b[0]} (tokens {win[b[0]][0]}–{win[b[0]][1]})"
                    if len(b) == 1
                    else f"comp rows {b[0]}–{b[-1]} (tokens {win[b[0]][0]}–{win[b[-1]][1]})"
                ),
            )
            + ["sink"]
        )
        m = self.model
        with m.hold_sync():
            m.title = (
                f"layer {layer} (ratio {amap.ratio or '—'}), head {head}: {len(qs)} queries × "
                f"{amap.n_raw} raw | {amap.n_comp} compressed | sink"
            )
            m.rows, m.cols = img.shape
            m.row_factor, m.col_factor, m.vmax = fr, fc, vmax
            m.groups = [dict(name=n, start=s, stop=e) for n, s, e in spans]
            m.row_labels, m.col_labels = row_labels, col_labels
            m.buf, m.marks = img.tobytes(), marks.tobytes()

    def static_html(self) -> str:
        m = self.model
        img = np.frombuffer(m.buf, np.uint8).reshape(m.rows, m.cols)
        rgb = colormap(img)
        marks = np.frombuffer(m.marks, np.uint8).reshape(m.rows, m.cols)
        rgb[(marks == 1) & (img == 0)] = (252, 187, 161)
        scale = max(1, min(6, 720 // max(m.rows, m.cols, 1)))
        groups = " | ".join(f"{g['name']} {g['stop'] - g['start']}" for g in m.groups)
        return (
            f"<div class='ds4-view' style='font:12px monospace'><b>{html.escape(m.title)}</b><br>"
            f"<img alt='attention heatmap' style='image-rendering:pixelated;width:{m.cols * scale}px;"
            f"height:{m.rows * scale}px' src='data:image/png;base64,{png_base64(rgb)}'/><br>"
            f"{m.rows}×{m.cols} cells, max-pooled ×{m.row_factor} queries ×{m.col_factor} keys; weight 0…{m.vmax:.3g}; "
            f"columns: {groups}</div>"
        )

    def _repr_png_(self):
        from .reduce import png_bytes

        img = np.frombuffer(self.model.buf, np.uint8).reshape(self.model.rows, self.model.cols)
        return png_bytes(colormap(img))
