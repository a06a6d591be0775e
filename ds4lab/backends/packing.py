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


def pack(arrays: list[np.ndarray]) -> tuple[np.ndarray, list[int]]:
    """Host arrays in one uint8 buffer; returns the buffer and each array's offset."""
    offs, size = offsets(a.nbytes for a in arrays)
    buf = np.zeros(size, dtype=np.uint8)
    for a, o in zip(arrays, offs):
        buf[o:o + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return buf, offs


def views(buf, arrays, offs) -> list:
    """The arrays of a packed buffer (any library with NumPy's slicing and ``view``), shaped like ``arrays``.
    A CuPy buffer's are made from its memory pointer, one constructor call each rather than a slice, a view
    and a reshape: a decode step makes one per state array, on the host's side of the step."""
    data = getattr(buf, "data", None)
    if hasattr(data, "ptr"):  # a CuPy MemoryPointer (NumPy's data is a memoryview)
        return [type(buf)(a.shape, a.dtype, memptr=data + o) for a, o in zip(arrays, offs)]
    return [buf[o:o + a.nbytes].view(a.dtype).reshape(a.shape) for a, o in zip(arrays, offs)]
