"""Reductions done in Python before anything is sent to the browser, and a dependency-free PNG writer
for the static fallbacks."""

from __future__ import annotations

import base64
import math
import struct
import zlib

import numpy as np

MAX_SIDE = 512


def pool_factor(n: int, limit: int) -> int:
    return max(1, math.ceil(n / limit)) if limit > 0 else 1


def maxpool(a: np.ndarray, fr: int, fc: int) -> np.ndarray:
    """Max over ``fr × fc`` blocks of a 2-D array (edges padded with −inf, so partial blocks pool what they hold)."""
    R, C = a.shape
    rr, cc = math.ceil(R / fr), math.ceil(C / fc)
    padded = np.full((rr * fr, cc * fc), -np.inf)
    padded[:R, :C] = a
    return padded.reshape(rr, fr, cc, fc).max(axis=(1, 3))


def reduce_groups(
    weights: np.ndarray, groups: list[tuple[str, int]], max_rows: int = MAX_SIDE, max_cols: int = MAX_SIDE
):
    """Max-pool ``weights [Q, K]`` whose columns are consecutive labelled groups ``[(name, width)]``.

    Each group is pooled on its own with one column factor (so no reduced column mixes raw keys with
    compressed rows or the sink), the rows with one row factor. Returns
    ``(reduced [q, k], row_factor, col_factor, [(name, start, stop)] of the reduced columns)``.
    """
    Q, K = weights.shape
    fr = pool_factor(Q, max_rows)
    n_groups = sum(1 for _, w in groups if w)
    fc = 1
    while sum(math.ceil(w / fc) for _, w in groups if w) > max_cols and fc < K:
        fc = max(fc + 1, pool_factor(K, max_cols - n_groups))
    parts, spans, col, out_col = [], [], 0, 0
    for name, w in groups:
        f = 1 if w <= 1 else fc
        part = maxpool(weights[:, col : col + w], fr, f) if w else np.zeros((math.ceil(Q / fr), 0))
        parts.append(part)
        spans.append((name, out_col, out_col + part.shape[1]))
        col, out_col = col + w, out_col + part.shape[1]
    return np.concatenate(parts, axis=1), fr, fc, spans


def to_uint8(a: np.ndarray, vmax: float | None = None) -> tuple[np.ndarray, float]:
    """Linear 0…vmax → 0…255 (vmax defaults to the array's max); returns (bytes array, vmax)."""
    vmax = float(np.max(a)) if vmax is None and a.size else (vmax or 0.0)
    if vmax <= 0:
        return np.zeros(a.shape, np.uint8), vmax
    return np.clip(np.rint(np.asarray(a, dtype=np.float64) / vmax * 255.0), 0, 255).astype(np.uint8), vmax


def colormap(v: np.ndarray) -> np.ndarray:
    """uint8 → RGB along a white → blue → dark-purple ramp (the same ramp the front-end draws)."""
    t = v.astype(np.float64)[..., None] / 255.0
    lo, mid, hi = np.array([255, 255, 255.0]), np.array([49, 130, 189.0]), np.array([40, 10, 80.0])
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
