"""Several arrays laid out in one buffer at aligned offsets: host arrays sent to a GPU in one transfer
(CuPy's ``upload``), and a CUDA graph's inputs and outputs copied as one span (:mod:`ds4lab.cuda.graphs`).
The layout depends only on the arrays' byte sizes, so a run of arrays laid out this way in one buffer
sits at the same relative offsets in any other buffer laid out this way."""

from __future__ import annotations

import numpy as np

ALIGN = 256  # bytes; every array starts at a multiple (CUDA allocations are aligned this way too)


def offsets(nbytes) -> tuple[list[int], int]:
    """Offsets of arrays of ``nbytes`` bytes laid out in order, and the buffer's size."""
    out, end = [], 0
    for n in nbytes:
        out.append(end)
        end += -(-int(n) // ALIGN) * ALIGN
    return out, max(end, ALIGN)


def views(buf, arrays, offs) -> list:
    """The arrays of a packed buffer (any library with NumPy's slicing and ``view``), shaped like ``arrays``."""
    if hasattr(getattr(buf, "data", None), "ptr"):  # a CuPy MemoryPointer (NumPy's data is a memoryview)
        return [view_at(buf, a.shape, a.dtype, o) for a, o in zip(arrays, offs)]
    return [buf[o:o + a.nbytes].view(a.dtype).reshape(a.shape) for a, o in zip(arrays, offs)]


def view_at(buf, shape, dtype, offset: int):
    """The array of ``shape`` and ``dtype`` at byte ``offset`` of a CuPy buffer, made from its memory pointer
    in one constructor call rather than a slice, a view and a reshape (a decode step makes several on the
    host's side of the step)."""
    return type(buf)(shape, dtype, memptr=buf.data + offset)


def pieces(spans, size: int, most: int) -> tuple[np.ndarray, int]:
    """Spans ``(source, destination, bytes)`` (addresses, 16-byte aligned) cut into pieces of ``size`` bytes (a
    multiple of 16; a span's last piece the rest), so that a copy launch gives each piece the same few work-groups
    whatever the spans' sizes: ``(uint64 [3, m] of the pieces' sources, destinations and bytes, the size used)``.
    Where they would be more than ``most`` pieces the size is doubled until they are not (a span is one piece at
    least)."""
    src, dst, nbytes = (np.asarray(a, dtype=np.uint64) for a in zip(*spans)) if spans else [np.zeros(0, np.uint64)] * 3
    while True:
        k = np.maximum(1, -(-nbytes.astype(np.int64) // size))  # pieces a span
        if k.sum() <= max(most, len(k)):
            break
        size *= 2
    span = np.repeat(np.arange(len(k)), k)
    off = ((np.arange(k.sum()) - np.repeat(np.cumsum(k) - k, k)) * size).astype(np.uint64)
    return np.stack([src[span] + off, dst[span] + off, np.minimum(nbytes[span] - off, np.uint64(size))]), size


def _minus(ranges, cut) -> tuple:
    """Row ranges ``((start, stop), ...)`` less the rows of the ranges ``cut``."""
    out = []
    for a, b in ranges:
        parts = [(a, b)]
        for c, d in cut:
            parts = [p for x, y in parts for p in ((x, min(y, c)), (max(x, d), y)) if p[0] < p[1]]
        out += parts
    return tuple(out)


def stale_rows(live, then, written):
    """The row ranges of ``live`` (the rows of an array that later steps read) that an earlier copy of the array does
    not hold as they are now: the rows that were not among its live rows when it was made (``then``) or that a step
    since wrote (``written``: each step's row ranges). None (every row) where ``live``, ``then`` or any step's writes
    are None. A copy brought up to date with these rows holds the array's live rows as a copy made now would."""
    if live is None or then is None or any(w is None for w in written):
        return live
    held = _minus(then, [r for w in written for r in w])
    return _minus(live, held)
