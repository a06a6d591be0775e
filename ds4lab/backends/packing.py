"""Several arrays laid out in one buffer at aligned offsets: host arrays sent to a GPU in one transfer
(CuPy's ``upload``), and a CUDA graph's inputs and outputs copied as one span (:mod:`ds4lab.cuda.graphs`).
The layout depends only on the arrays' byte sizes, so a run of arrays laid out this way in one buffer
sits at the same relative offsets in any other buffer laid out this way."""

from __future__ import annotations

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
