"""Reductions done in Python before anything is sent to the browser, and a dependency-free PNG writer
for the static fallbacks."""

from __future__ import annotations

import base64
import math
import struct
import zlib

import numpy as np

from . import palette

SCALES = ("linear", "row", "log")  # colour scales: weight / max, weight / its row's max, log10 weight
LOG_DECADES = 4  # the log scale spans max·10⁻⁴ … max


def pool_factor(n: int, limit: int) -> int:
    return max(1, math.ceil(n / limit)) if limit > 0 else 1


def maxpool(a: np.ndarray, fr: int, fc: int) -> np.ndarray:
    """Max over ``fr × fc`` blocks of a 2-D array (partial blocks at the edges pool what they hold)."""
    out = np.asarray(a, dtype=np.float64)
    if 0 in out.shape:
        return np.zeros((-(-out.shape[0] // fr), -(-out.shape[1] // fc)))
    if fc > 1:
        out = np.maximum.reduceat(out, np.arange(0, out.shape[1], fc), axis=1)
    if fr > 1:
        out = np.maximum.reduceat(out, np.arange(0, out.shape[0], fr), axis=0)
    return out if out is not a else out.copy()


def column_factor(widths: list[int], slots: int) -> int:
    """The smallest factor f with Σ ⌈w / f⌉ ≤ ``slots`` over the groups ``widths`` (each group pooled on its own)."""
    if slots < 1:
        raise ValueError(f"slots must be ≥ 1, got {slots}")
    f = pool_factor(sum(widths), slots)
    while sum(math.ceil(w / f) for w in widths) > slots:
        f += 1
    return f


def pool_groups(weights: np.ndarray, widths: list[int], fr: int, fc: int, pooled: list[bool] | None = None):
    """Max-pool ``weights [Q, K]`` whose columns are consecutive groups of ``widths``: rows by ``fr``, each group's
    columns by ``fc`` on its own (no reduced column mixes two groups); a group with ``pooled[i]`` False keeps its
    columns. Returns ``(reduced [q, k], [(start, stop)] of each group's reduced columns)``."""
    pooled = [True] * len(widths) if pooled is None else pooled
    if sum(widths) != weights.shape[1]:
        raise ValueError(f"group widths {widths} do not add up to the {weights.shape[1]} columns")
    parts, spans, col, out = [], [], 0, 0
    for w, p in zip(widths, pooled):
        part = maxpool(weights[:, col : col + w], fr, fc if p else 1) if w else np.zeros((-(-len(weights) // fr), 0))
        parts.append(part)
        spans.append((out, out + part.shape[1]))
        col, out = col + w, out + part.shape[1]
    return np.concatenate(parts, axis=1), spans


def edges(n: int, px: int, start: int = 0) -> np.ndarray:
    """Pixel edges of ``n`` cells sharing ``px`` pixels from ``start`` (widths differ by at most 1 px): ``[n + 1]``."""
    return start + np.rint(np.arange(n + 1) * (px / max(n, 1))).astype(np.int64)


def scale_colours(values: np.ndarray, scale: str, decades: int = LOG_DECADES,
                  row_max: np.ndarray | None = None) -> tuple[np.ndarray, float, float]:
    """Colour indices 0…255 of ``values [rows, cols]`` (≥ 0) on ``scale``, and the range (lo, hi) 0 and 255 stand for.

    - ``linear``: v / max · 255, range (0, max);
    - ``row``: each row v / that row's max · 255 (a row of zeros stays 0), range (0, 1): the fraction of the row's max;
      ``row_max [rows]`` gives the maxima where ``values`` are part of their rows (a zoomed view's columns);
    - ``log``: (log10 v − log10 lo) / decades · 255 with hi = max, lo = max · 10^−decades, values below lo at 0.
    """
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    v = np.asarray(values, dtype=np.float64)
    hi = float(v.max()) if v.size else 0.0
    if hi <= 0:
        return np.zeros(v.shape, np.uint8), 0.0, hi
    if scale == "linear":
        t, lo = v / hi, 0.0
    elif scale == "row":
        row_max = v.max(axis=1, keepdims=True) if row_max is None else np.asarray(row_max, np.float64)[:, None]
        t, lo, hi = np.divide(v, row_max, out=np.zeros_like(v), where=row_max > 0), 0.0, 1.0
    else:
        lo = hi * 10.0**-decades
        t = (np.log10(np.maximum(v, lo)) - math.log10(lo)) / decades
    return np.clip(np.rint(t * 255.0), 0, 255).astype(np.uint8), lo, hi


# A weight's ramp in each key group: white -> the group's colour -> its darkest shade, so a cell says which kind of
# row it is as the mass bars and the KV view do (blue raw, green compressed; palette.py), and how much weight it has
RAMPS = {"raw": ((255, 255, 255), palette.rgb(palette.RAW), (8, 48, 107)),
         "comp": ((255, 255, 255), palette.rgb(palette.COMPRESSED), (0, 68, 27)),
         "sink": ((255, 255, 255), palette.rgb(palette.SINK), (0, 0, 0))}


def colormap(v: np.ndarray, group="raw") -> np.ndarray:
    """uint8 → RGB along the ramp of the key group ``group`` (:data:`RAMPS`; the same ramps the front-end draws):
    a name, or an array of names along ``v``'s last axis (a map's columns)."""
    t = v.astype(np.float64)[..., None] / 255.0
    names = np.asarray(group)
    stops = np.array([RAMPS[n] for n in names.ravel()], np.float64).reshape(*names.shape, 3, 3)
    lo, mid, hi = stops[..., 0, :], stops[..., 1, :], stops[..., 2, :]
    rgb = np.where(t < 0.5, lo + (mid - lo) * (t * 2), mid + (hi - mid) * (t * 2 - 1))
    return np.rint(rgb).astype(np.uint8)


def png_bytes(rgb: np.ndarray) -> bytes:
    """A PNG of an ``[H, W, 3]`` uint8 image (no imaging library needed)."""
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(h))

    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )


def png_base64(rgb: np.ndarray) -> str:
    return base64.b64encode(png_bytes(rgb)).decode("ascii")
