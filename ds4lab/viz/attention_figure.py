"""The AttentionView figure's geometry (one layout, drawn by ``widgets/attention.js`` on a canvas and here as the
static PNG) and the static drawing: the heatmap with its three key groups, axes with positions, group labels, the
per-query mass bars (raw | compressed | sink) and the colour bar, and the legend (masked, not yet compressed,
dropped by the indexer, the key groups' colours: their cells' ramps and mass bars)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from . import palette
from .pixel_font import ADVANCE, draw_text
from .reduce import colormap

WIDTH, HEIGHT = 720, 480  # px of the heatmap: keys across, queries down, whatever the map's shape
MIN_CELL = 3  # px: a cell is never drawn smaller; more cells than fit are max-pooled
GAP = 4  # px between two key groups
SINK_PX = 14  # px of the sink column
# a compressed group of few rows (a ratio-128 layer's) is never pooled and its columns are FEW_PX wide at least, so
# that they can be told apart and hovered: up to FEW_COLS of them, a quarter of the heatmap
FEW_PX = 22
FEW_COLS = WIDTH // 4 // FEW_PX
HEADER_CHAR = 7  # px per character of a group header at most (11 px monospace on the canvas: 6.6; the pixel font: 6)
SHORT = {"raw": "raw", "comp": "comp", "sink": "sink"}  # a group's header where its full one has no room
# px between two group headers, a thin line in their middle (4 px apart, "comp sink" read as one phrase); only
# HEADER_MIN where a group is too narrow for more (one compressed row beside the sink), the line still between
HEADER_SEP, HEADER_MIN = 10, 4
SEP_Y = (15, 29)  # px: the separator's rows, the header line's height
LEFT, TOP = 118, 40  # query axis (positions and tokens) | group labels above the heatmap
MASS_GAP, MASS_W = 14, 84  # the stacked bar of each query's mass, right of the heatmap
X_LABELS = 76  # px under the heatmap for the key positions (written bottom to top)
LEGEND = 40  # px for the colour bar and the legend
FIG_W = LEFT + WIDTH + MASS_GAP + MASS_W + 10
FIG_H = TOP + HEIGHT + X_LABELS + LEGEND
GROUP_COLOURS = {"raw": palette.rgb(palette.RAW), "comp": palette.rgb(palette.COMPRESSED),
                 "sink": palette.rgb(palette.SINK)}
MASS_KEY = (("raw", "raw window"), ("comp", "compressed"), ("sink", "sink"))  # the key groups' legend
GROUPS_KEY = "cells, bars:"  # their colours key both: a cell's ramp and a query's mass bar
# Cells of weight exactly 0, by why (the MaskView's colours of the same categories: mask_view.COLOURS); every
# other cell is drawn by its weight on its key group's ramp (reduce.RAMPS: blue raw, green compressed)
MASKED = (217, 217, 217)  # a future key, or one outside the raw window: a grey apart from a weight near 0
NOT_YET = palette.rgb(palette.NOT_YET)  # a compressed row whose group of tokens ends after the query
DROPPED = palette.rgb(palette.DROPPED)  # a compressed row the indexer did not select for this query
MARK_DROPPED, MARK_MASKED, MARK_NOT_YET = 1, 2, 3
ZERO_KEY = ((MASKED, "weight 0 (masked)"), (NOT_YET, "not yet compressed"), (DROPPED, "dropped by the indexer"))
ZERO_KEY_MARKS = (MARK_MASKED, MARK_NOT_YET, MARK_DROPPED)  # each keyed only where the figure has such a cell
TEXT, FAINT = (34, 34, 34), (120, 120, 120)


def geometry() -> dict:
    """The fixed frame both renderers share (px)."""
    return dict(width=FIG_W, height=FIG_H, left=LEFT, top=TOP, hw=WIDTH, hh=HEIGHT, mass_x=LEFT + WIDTH + MASS_GAP,
                mass_w=MASS_W, legend_y=TOP + HEIGHT + X_LABELS, sep_y=list(SEP_Y))


def place_headers(groups: list[dict]) -> None:
    """The groups' headers on one line above the heatmap, never overlapping: right to left, each centred over its
    group, moved left off the next one's (the sink's may reach into the gap before the mass bars); the full label,
    else the short one, else none, whichever first keeps its middle over its own group, HEADER_SEP px off the next
    header where that fits, else HEADER_MIN. Sets ``label`` and ``label_x`` (the middle, px from the heatmap's left)
    of each group, and ``sep``: whether a line separates its header from the next one's, close to it
    (:func:`separators`)."""
    right, after = WIDTH + MASS_GAP - 4, False  # the left end of the header right of this one; whether there is one
    for grp in reversed(groups):
        x0, x1 = grp["x0"], grp["x1"]
        tries = [(text, pad) for text in (grp["label"], SHORT[grp["name"]])
                 for pad in ((HEADER_SEP, HEADER_MIN) if after else (0,))]
        for text, pad in [*tries, ("", 0)]:
            half = HEADER_CHAR * len(text) / 2
            mid = min((x0 + x1) / 2, right - pad - half)
            if not text or (x0 <= mid <= x1 and mid >= half):
                break
        grp["label"], grp["label_x"] = text, mid
        grp["sep"] = bool(text and after and right - (mid + half) < 2 * HEADER_SEP)  # farther apart, they read apart
        if text:
            right, after = mid - half, True


def separators(groups: list[dict], char_px: float) -> list[float]:
    """The x of each header separator (px from the heatmap's left): the middle of the gap between a header marked
    ``sep`` and the next one at ``char_px`` px a character, the renderer's font (a full label at HEADER_CHAR would
    put the line off the middle, nearer the next header)."""
    shown = [g for g in groups if g["label"]]
    return [(a["label_x"] + char_px * len(a["label"]) / 2 + b["label_x"] - char_px * len(b["label"]) / 2) / 2
            for a, b in zip(shown, shown[1:]) if a["sep"]]


def mass_segments(mass, x0: int, width: int) -> list[tuple[str, int, int]]:
    """The raw | comp | sink segments of one stacked bar of ``width`` px from x0: [(group, x_start, x_stop)]."""
    cuts = x0 + np.rint(np.cumsum([0.0, *mass]) / max(sum(mass), 1e-300) * width).astype(int)
    return [(g, int(cuts[i]), int(cuts[i + 1])) for i, g in enumerate(("raw", "comp", "sink"))]


def column_groups(groups: list[dict], cols: int) -> np.ndarray:
    """The key group (raw, comp, sink) of each of the map's ``cols`` columns: the ramp its cells are drawn on."""
    names = np.full(cols, "raw", dtype=object)
    for grp in groups:
        names[grp["start"] : grp["stop"]] = grp["name"]
    return names


BAR_H = 20  # px of the colour bar: two stripes of 8, 4 apart, each named on its left (touching, read as one ramp)
STRIPE_NAMES = {"raw": "raw", "comp": "compressed", "sink": "sink"}
STRIPE_NAME_GAP = 8  # px between a stripe's name and the scale's low end ("0", "9.5e-05") left of the bar


def stripe_name(name: str, lo_width: float, width_of: Callable[[str], float]) -> tuple[str, float]:
    """A stripe's name and the x of its right end: left of the scale's low end (``lo_width`` px, ending 6 px left of
    the bar), STRIPE_NAME_GAP apart; the short name where the full one would come within 4 px of the figure's edge
    (a log scale's low end, "9.5e-05", was drawn over "raw" and "compressed"). ``width_of``: a text's width in px."""
    right = LEFT - 6 - lo_width - STRIPE_NAME_GAP
    full = STRIPE_NAMES[name]
    return (full if width_of(full) <= right - 4 else SHORT[name]), right


def ramp_stripes(groups: list[dict]) -> list[tuple[str, int, int]]:
    """The colour bar's stripes (group, y0, y1 px in its BAR_H): the raw and compressed ramps one above the other
    where the map shows both, else the one it shows (the sink's only where a zoom shows nothing else: one column
    beside them, its mass bar and header say it)."""
    shown = [n for n in ("raw", "comp") if any(g["name"] == n for g in groups)]
    if len(shown) == 2:
        return [("raw", 0, 8), ("comp", 12, BAR_H)]
    return [(shown[0] if shown else "sink" if groups else "raw", 0, BAR_H)]


def draw_static(state: dict) -> np.ndarray:
    """The figure as an RGB image ``[FIG_H, FIG_W, 3]`` from the model's state (the same one the canvas draws)."""
    g = geometry()
    img = np.full((g["height"], g["width"], 3), 255, np.uint8)
    rows, cols = state["rows"], state["cols"]
    idx = np.frombuffer(state["buf"], np.uint8).reshape(rows, cols)
    marks = np.frombuffer(state["marks"], np.uint8).reshape(rows, cols)
    rgb = colormap(idx, column_groups(state["groups"], cols))
    rgb[marks == MARK_MASKED] = MASKED
    rgb[marks == MARK_DROPPED] = DROPPED
    rgb[marks == MARK_NOT_YET] = NOT_YET
    ys = np.asarray(state["row_edges"]) + TOP
    xs = np.asarray(state["col_edges"]) + LEFT  # [cols, 2]
    # every cell as a block: the image indexed by the cell under each pixel
    row_of = np.repeat(np.arange(rows), np.diff(ys))
    col_of = np.full(WIDTH, -1)
    for c, (a, b) in enumerate(xs - LEFT):
        col_of[a:b] = c
    px = np.nonzero(col_of >= 0)[0]
    img[ys[0] : ys[-1], LEFT + px] = rgb[row_of[:, None], col_of[px][None, :]]
    for grp in state["groups"]:  # a frame around each group
        x0, x1 = grp["x0"] + LEFT, grp["x1"] + LEFT
        img[TOP - 1, x0 - 1 : x1 + 1] = img[TOP + HEIGHT, x0 - 1 : x1 + 1] = FAINT
        img[TOP - 1 : TOP + HEIGHT + 1, x0 - 1] = img[TOP - 1 : TOP + HEIGHT + 1, x1] = FAINT
        draw_text(img, LEFT + round(grp["label_x"]), 18, grp["label"], TEXT, anchor="center")  # place_headers
        img[TOP - 6, x0:x1] = GROUP_COLOURS[grp["name"]]
    for x in separators(state["groups"], ADVANCE):
        img[SEP_Y[0] : SEP_Y[1], LEFT + round(x)] = FAINT
    for x, text in state["xticks"]:
        img[TOP + HEIGHT + 1 : TOP + HEIGHT + 4, LEFT + int(x)] = FAINT
        draw_text(img, LEFT + int(x), TOP + HEIGHT + 6, text, TEXT, vertical=True)
    for y, text in state["yticks"]:
        img[TOP + int(y), LEFT - 4 : LEFT - 1] = FAINT
        draw_text(img, LEFT - 6, TOP + int(y) - 3, text, TEXT, anchor="right")
    draw_text(img, 4, TOP - 12, state["y_title"], FAINT)
    # the mass bars
    mx = g["mass_x"]
    draw_text(img, mx, 6, "mass of query", FAINT)  # grey as the query axis' title, apart from the group headers
    draw_text(img, mx, 18, "by key group", FAINT)
    for r, m in enumerate(state["mass"]):
        for name, a, b in mass_segments(m, mx, MASS_W):
            img[ys[r] : ys[r + 1], a:b] = GROUP_COLOURS[name]
    # the colour bar and the legend
    ly = g["legend_y"] + 4
    mid = ly + BAR_H // 2 - 3  # the pixel font's 7 rows centred on the bar
    draw_text(img, LEFT - 6, mid, state["lo_text"], TEXT, anchor="right")
    draw_text(img, LEFT + 262, mid, state["hi_text"], TEXT)
    draw_text(img, LEFT + 262 + ADVANCE * len(state["hi_text"]) + 12, mid, state["scale_text"], TEXT)
    stripes = ramp_stripes(state["groups"])
    for name, y0, y1 in stripes:
        img[ly + y0 : ly + y1, LEFT : LEFT + 256] = colormap(np.arange(256, dtype=np.uint8), name)[None, :, :]
        if len(stripes) == 2:  # left of the scale's low end
            text, right = stripe_name(name, ADVANCE * len(state["lo_text"]), lambda t: ADVANCE * len(t))
            draw_text(img, round(right), ly + (y0 + y1) // 2 - 3, text, TEXT, anchor="right")
    ly += BAR_H + 6  # the key's swatches 26 px under the bar's top, as the canvas draws them
    x = LEFT
    present = set(np.frombuffer(state["marks"], np.uint8).tolist())  # as the canvas: the kinds the figure shows
    for (colour, text), mark in zip(ZERO_KEY, ZERO_KEY_MARKS):
        if mark not in present:
            continue
        img[ly : ly + 8, x : x + 12] = colour
        draw_text(img, x + 16, ly + 1, text, TEXT)
        x += 16 + ADVANCE * len(text) + 18
    draw_text(img, x, ly + 1, GROUPS_KEY, TEXT)  # the key of the groups' colours: the cells' ramps, the mass bars
    x += ADVANCE * len(GROUPS_KEY) + 8
    for i, (name, text) in enumerate(MASS_KEY):
        if not any(m[i] > 0 for m in state["mass"]):  # keyed only where some query's bar has it
            continue
        img[ly : ly + 8, x : x + 12] = GROUP_COLOURS[name]
        draw_text(img, x + 16, ly + 1, text, TEXT)
        x += 16 + ADVANCE * len(text) + 14
    return img
