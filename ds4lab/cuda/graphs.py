"""CUDA graphs for CuPy: a function of device arrays captured once per set of shapes and replayed.

A decode step is a few hundred small launches per layer; launched one by one from Python, the host is
the bottleneck (milliseconds per layer against microseconds of GPU work). Replaying a captured graph
launches all of them at once.

The first call with a set of shapes runs eagerly: it compiles the kernels and makes every launch
constant, so the capture that the second call makes copies nothing from the host; the graph holds the
launch plans it reads, which the launchers' caches may later drop (:func:`ds4lab.mlx_kernels.launches.holding`).
Every buffer the capture allocates comes from a memory pool of its own that nothing outside the graphs
uses, so a replay never writes into memory someone else holds. A replay copies its arguments into the graph's input
buffer and returns a copy of its outputs: what a caller holds (a checkpoint's KV arrays, say) is never
overwritten by a later replay. Inputs and outputs are each one buffer, so a decode step whose state
came out of the previous replay copies it in, and its new state out, as one span each; the outputs are
:class:`Outputs`, whose arrays are made only when read, and a slice of them (a :class:`Span`) is passed
to the next replay whole, so the host makes no array object per state array and step. A function that
cannot be captured (it syncs with the host) runs eagerly from then on; ``failures`` says why.
"""

from __future__ import annotations

from collections.abc import Sequence

import cupy as cp

from ..backends.packing import offsets, view_at, views
from ..mlx_kernels.launches import holding

_POOLS: dict[int, cp.cuda.MemoryPool] = {}  # per device: the memory every captured graph allocates from


def _graph_pool() -> cp.cuda.MemoryPool:
    device = cp.cuda.Device().id
    if device not in _POOLS:
        _POOLS[device] = cp.cuda.MemoryPool()
    return _POOLS[device]


class _Layout:
    """Shapes, dtypes and offsets of arrays laid out in one buffer (:func:`ds4lab.backends.packing.offsets`)."""

    def __init__(self, arrays):
        self.signature = tuple((a.shape, a.dtype) for a in arrays)  # a graph's key is made of these
        self.nbytes = [a.nbytes for a in arrays]
        self.offs, self.size = offsets(self.nbytes)


class Outputs(Sequence):
    """A replay's outputs, in one buffer of their own; each array is made on first read. A slice is a
    :class:`Span`."""

    def __init__(self, buf, layout: _Layout):
        self.buf, self.layout = buf, layout
        self._arrays = [None] * len(layout.offs)

    def __len__(self) -> int:
        return len(self._arrays)

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, stride = i.indices(len(self))
            return Span(self, start, max(start, stop)) if stride == 1 else [self[j] for j in range(start, stop, stride)]
        a = self._arrays[i]
        if a is None:
            shape, dtype = self.layout.signature[i]
            a = self._arrays[i] = view_at(self.buf, shape, dtype, self.layout.offs[i])
        return a


class Span(Sequence):
    """Arrays ``start:stop`` of a replay's :class:`Outputs`: one range of one buffer, which a replay takes as
    one argument (standing for its arrays) and copies in as one span."""

    def __init__(self, outputs: Outputs, start: int, stop: int):
        self.outputs, self.start, self.stop = outputs, start, stop
        layout = outputs.layout
        self.signature = layout.signature[start:stop]
        self.data = outputs.buf.data + (layout.offs[start] if stop > start else 0)
        self.nbytes = layout.offs[stop - 1] + layout.nbytes[stop - 1] - layout.offs[start] if stop > start else 0

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        return self.outputs[self.start + i % len(self)]


def _arguments(args) -> tuple[list, list]:
    """The arguments as contiguous arrays and Spans, and the shapes and dtypes of the arrays they stand for."""
    out, signature = [], []
    for a in args:
        if type(a) is Span:
            signature += a.signature
        else:
            a = a if a.flags.c_contiguous else cp.ascontiguousarray(a)  # it makes 0-d arrays 1-d
            signature.append((a.shape, a.dtype))
        out.append(a)
    return out, signature


def _flat(args) -> list:
    """Arrays only: each :class:`Span` replaced by its arrays."""
    return [x for a in args for x in (a if type(a) is Span else (a,))]


class _Captured:
    """One captured graph. Its inputs and its outputs each live in one buffer, laid out by
    :func:`ds4lab.backends.packing.offsets`: a run of arguments that sits in one buffer at those relative
    offsets (a replay's outputs, CuPy's packed upload) is copied in as one span, and the outputs leave
    as one copy."""

    def __init__(self, fn, args):
        in_layout = _Layout(args)
        self.in_offs = in_layout.offs
        self.in_buf = cp.empty(in_layout.size, dtype=cp.uint8)
        self.inputs = views(self.in_buf, args, self.in_offs)
        for dst, src in zip(self.inputs, args):
            dst[...] = src
        stream = cp.cuda.Stream(non_blocking=True)  # the legacy stream cannot be captured
        pool = _graph_pool()
        with cp.cuda.using_allocator(pool.malloc), stream, holding() as self.held:
            stream.begin_capture()
            try:
                outputs = fn(*self.inputs)
                self.layout = _Layout(outputs)
                self.out_buf = cp.empty(self.layout.size, dtype=cp.uint8)
                for dst, src in zip(views(self.out_buf, outputs, self.layout.offs), outputs):
                    dst[...] = src
            finally:
                self.graph = stream.end_capture()

    def _copy_in(self, args, stream) -> None:
        """One device copy per run of arguments that sits in one buffer at the input layout's relative
        offsets (a :class:`Span` is such a run)."""
        offs, i, run = self.in_offs, 0, None  # run: [source pointer, its memory, base, start, end]
        for a in args:
            n = len(a) if type(a) is Span else 1
            if n == 0:
                continue
            src, start = a.data, offs[i]
            base, end = src.ptr - start, start + a.nbytes
            i += n
            if run is not None and src.mem is run[1] and base == run[2]:
                run[4] = end
                continue
            if run is not None:
                self._copy(run, stream)
            run = [src, src.mem, base, start, end]
        if run is not None:
            self._copy(run, stream)

    def _copy(self, run, stream) -> None:
        src, _, _, start, end = run
        (self.in_buf.data + start).copy_from_device_async(src, end - start, stream)

    def __call__(self, args) -> Outputs:
        stream = cp.cuda.get_current_stream()
        self._copy_in(args, stream)
        self.graph.launch(stream)
        out = cp.empty_like(self.out_buf)
        out.data.copy_from_device_async(self.out_buf.data, self.out_buf.nbytes, stream)
        return Outputs(out, self.layout)


class GraphStep:
    """``fn(*arrays) -> tuple of arrays`` (arrays on the current device), replayed as a CUDA graph. An
    argument may be a :class:`Span` of an earlier replay's outputs, standing for its arrays (copied in as
    one span)."""

    def __init__(self, fn):
        self.fn = fn
        self._graphs: dict[tuple, _Captured] = {}
        self._ran: set[tuple] = set()
        self.failures: dict[tuple, str] = {}
        self.captures = 0

    def __call__(self, *args):
        args, signature = _arguments(args)
        key = (cp.cuda.runtime.getDevice(), *signature)
        captured = self._graphs.get(key)
        if captured is not None:
            return captured(args)
        args = _flat(args)
        if key not in self._ran or key in self.failures:
            self._ran.add(key)
            return self.fn(*args)
        try:
            self._graphs[key] = captured = _Captured(self.fn, args)
        except Exception as e:  # a host sync or an uncapturable call inside fn (a real bug re-raises below)
            self.failures[key] = f"{type(e).__name__}: {e}"
            return self.fn(*args)
        self.captures += 1
        return captured(args)

    def replay_seconds(self, repeats: int = 20) -> list[float]:
        """GPU seconds of one bare replay (no argument copies) of each graph captured, replayed back to back
        (a benchmark's view of the GPU work against the host's)."""
        stream, seconds = cp.cuda.get_current_stream(), []
        for captured in self._graphs.values():
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            for _ in range(repeats):
                captured.graph.launch(stream)
            end.record(stream)
            end.synchronize()
            seconds.append(cp.cuda.get_elapsed_time(start, end) / 1e3 / repeats)
        return seconds
