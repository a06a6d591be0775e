"""MaskView: what each query of one step (a prefill chunk or a decode step) of one layer can see, drawn as a mask:
queries down, keys across grouped as [raw rows cached by earlier steps | the step's own rows | compressed rows |
sink], each cell coloured by why it is seen or not (:mod:`ds4lab.visibility`; front-end ``widgets/mask.js``)."""

from __future__ import annotations

import html

import numpy as np
import traitlets as t

from ..config import check_count
from ..visibility import CATEGORIES, DROPPED, UNKNOWN, StepMask, step_mask
from . import palette
from .attention_figure import FEW_PX, SINK_PX
from .base import View, ViewModel, widget_module
from .reduce import png_base64

# a few compressed rows (a ratio-128 layer's, up to FEW_MAX_PX together: a quarter of a PrefillView mask's 480 px
# of keys) get columns FEW_PX wide at least, as in the AttentionView: they can be told apart and hovered
FEW_MAX_PX = 120
# the px the live view's cells may take, keys across and queries down: a view of its own takes most of a notebook's
# output (960 px in JupyterLab at 1400); beside the PrefillView's KV cache, the room left there (PREFILL_SIZE_PX)
SIZE_PX = (720, 360)
PREFILL_SIZE_PX = (480, 260)
# One colour per category of ds4lab.visibility (index = category), shared by the widget and the fallback. Any two
# stay apart for a reader with deuteranopia or protanopia as well (tests/test_views_extra.py). The raw window's rows
# are blues and the compressed rows greens, as in the KV and attention views (palette.RAW, COMPRESSED); the
# indexer's states agree with the AttentionView (attention_figure): dropped by the indexer = DROPPED (salmon), not
# yet compressed = NOT_YET (pale yellow); the sink is its grey (palette).
COLOURS = ["#f4f4f4", "#bdbdbd", "#6baed6", "#08519c", palette.NOT_YET, palette.KEPT, palette.DROPPED, "#006d2c",
           palette.SINK]


class MaskModel(ViewModel):
    _esm = widget_module("mask.js", "hovertip.js", "text.js")
    cells = t.Bytes(b"").tag(sync=True)  # [Q, N] uint8 categories, row-major
    n_queries = t.Int(0).tag(sync=True)
    pos0 = t.Int(0).tag(sync=True)
    raw_positions = t.List(t.Int()).tag(sync=True)
    raw_slots = t.List(t.Int()).tag(sync=True)
    n_own = t.Int(0).tag(sync=True)
    n_comp = t.Int(0).tag(sync=True)
    ratio = t.Int(0).tag(sync=True)
    window = t.Int(0).tag(sync=True)
    top_k = t.Int(0).tag(sync=True)  # 0: no indexer on this layer
    layer = t.Int(0).tag(sync=True)
    label = t.Unicode("").tag(sync=True)
    categories = t.List(t.Unicode(), list(CATEGORIES)).tag(sync=True)
    colours = t.List(t.Unicode(), COLOURS).tag(sync=True)
    written = t.Unicode(palette.ACCENT).tag(sync=True)  # the bar over the rows the step wrote (the KV view's mark)
    x_title = t.Unicode("").tag(sync=True)  # the key axis' title: what the columns are
    few_px = t.Int(FEW_PX).tag(sync=True)  # widgets/mask.js widens a few compressed or own columns as image() does
    few_max_px = t.Int(FEW_MAX_PX).tag(sync=True)
    sink_px = t.Int(SINK_PX).tag(sync=True)  # the sink's column, as wide as the AttentionView's
    size_px = t.List(t.Int(), list(SIZE_PX)).tag(sync=True)  # the cells' room: keys across, queries down
    # the masks this view will show, as visibility.key_groups gives them (none: this mask alone): widgets/mask.js
    # sizes its cells and its image for the largest, so a stepper's mask keeps its scale and size
    plan = t.List(t.List(t.Int())).tag(sync=True)


def legend_names(mask: StepMask) -> list[str]:
    """The categories' names in the legend: a compressed row a query sees is "kept" only where the indexer chooses
    among more rows than its top k for some query of the mask; on a layer without an indexer it is seen (a
    walk-through read "kept" as the indexer's choice on a ratio-128 layer), and where no query sees more than k
    rows the indexer keeps them all (one read "kept" as a choice in a ratio-4 layer's first chunks)."""
    kept = ("seen (no indexer here)" if mask.top_k is None else "kept" if np.isin(mask.cells, [DROPPED, UNKNOWN]).any()
            else f"seen (≤ {mask.top_k} visible: the indexer keeps all)")
    return [kept if c == "kept" else c for c in CATEGORIES]


def key_axis_title(mask: StepMask) -> str:
    """The title of the key axis: raw rows by position, and compressed rows by index where there are any."""
    return "key position (raw rows) · compressed row" if len(mask.comp_rows) else "key position (raw rows)"


class MaskView(View):
    """The mask of a :class:`ds4lab.visibility.StepMask` (``MaskView.of_step(session, layer, pos0, n)`` makes
    one); ``show(mask, label)`` draws another. Hover a cell for the query, the key and the reason. ``size_px``:
    the room the live view's cells may take, keys across and queries down (cells 2-8 px wide, 3-14 px tall, 28 for
    one or two queries); the saved notebook's fallback image keeps its own sizes."""

    def __init__(self, mask: StepMask, label: str = "", size_px: tuple[int, int] = SIZE_PX):
        if not isinstance(size_px, (tuple, list)) or len(size_px) != 2:
            raise ValueError(f"size_px is {size_px!r}: expected two numbers of px (keys, queries)")
        self.model = MaskModel(size_px=[check_count(v, f"size_px[{i}]", of="px") for i, v in enumerate(size_px)])
        self.widget = self.model
        self.mask = mask
        self.show(mask, label)

    @classmethod
    def of_step(cls, session, layer: int, pos0: int, n: int, selected=None, label: str = "") -> MaskView:
        return cls(step_mask(session.model.config, session.geometry, layer, pos0, n, selected), label)

    def __repr__(self) -> str:
        m = self.mask
        return f"MaskView(layer {m.layer}, queries {m.pos0}–{m.pos0 + len(m.queries) - 1})"

    def show(self, mask: StepMask, label: str = "") -> None:
        self.mask = mask
        with self.model.hold_sync():
            self.model.cells = mask.cells.astype(np.uint8).tobytes()
            self.model.n_queries = len(mask.queries)
            self.model.pos0 = mask.pos0
            self.model.raw_positions = mask.raw_positions.tolist()
            self.model.raw_slots = mask.raw_slots.tolist()
            self.model.n_own = mask.n_own
            self.model.n_comp = len(mask.comp_rows)
            self.model.ratio = mask.ratio
            self.model.window = mask.window
            self.model.top_k = mask.top_k or 0
            self.model.categories = legend_names(mask)
            self.model.layer = mask.layer
            self.model.label = label
            self.model.x_title = key_axis_title(mask)

    def counts(self) -> dict[str, int]:
        """Cells per category (what the legend counts)."""
        n = np.bincount(self.mask.cells.ravel(), minlength=len(CATEGORIES))
        return {c: int(k) for c, k in zip(CATEGORIES, n) if k}

    def image(self) -> np.ndarray:
        """The mask as an RGB image for the fallback: cells a few pixels wide (a few compressed rows, or a step's few
        own rows, FEW_PX wide, as in the live view), groups apart by a white column."""
        mk = self.mask
        rgb = np.array([palette.rgb(c) for c in COLOURS], np.uint8)[mk.cells]
        nr, nc = len(mk.raw_positions), len(mk.comp_rows)
        cuts = [nr - mk.n_own, nr, nr + nc]  # group boundaries, left to right
        sx = max(1, min(6, 600 // (rgb.shape[1] + len(cuts))))
        sy = max(2, min(12, 240 // rgb.shape[0]))
        def widen(n):
            return max(sx, FEW_PX) if n * FEW_PX <= FEW_MAX_PX else sx

        px = [sx, widen(mk.n_own), widen(nc), max(sx, SINK_PX)]  # per column of each group
        gap = np.full((rgb.shape[0], sx, 3), 255, np.uint8)
        parts = [np.repeat(part, w, axis=1) for part, w in zip(np.split(rgb, cuts, axis=1), px)]
        for i in (1, 2, 3):  # a widened column ends in a white hairline (two of one colour stay apart), as live
            if px[i] > sx:
                parts[i][:, px[i] - 1 :: px[i]] = 255
        img = np.concatenate([p for part in parts for p in (part, gap)][:-1], axis=1)
        return np.ascontiguousarray(np.repeat(img, sy, axis=0))

    def static_html(self) -> str:
        m, mk = self.model, self.mask
        q = len(mk.queries)
        names = dict(zip(CATEGORIES, m.categories))
        swatch = "<span style='background:{}'>&nbsp;&nbsp;</span>"
        legend = " ".join(f"{swatch.format(COLOURS[CATEGORIES.index(c)])} {names[c]} {n:,}"
                          for c, n in self.counts().items())
        return (
            f"<div class='ds4-view' style='font:12px monospace'><b>What each query sees — layer {mk.layer}, "
            f"{html.escape(m.label)}</b><br>queries {mk.pos0}–{mk.pos0 + q - 1} × keys: "
            f"{len(mk.raw_positions) - mk.n_own} cached raw rows | {mk.n_own} own rows | {len(mk.comp_rows)} "
            f"compressed rows (ratio {mk.ratio or '—'}) | sink<br>"
            f"<img alt='mask' src='data:image/png;base64,{png_base64(self.image())}'><br>{html.escape(m.x_title)}<br>"
            f"{legend}</div>"
        )
