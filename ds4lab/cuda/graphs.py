"""CUDA graphs for CuPy: a function of device arrays captured once per set of shapes and replayed.

A decode step is a few hundred small launches per layer; launched one by one from Python, the host is
the bottleneck (milliseconds per layer against microseconds of GPU work). Replaying a captured graph
launches all of them at once.

The first call with a set of shapes runs eagerly: it compiles the kernels and makes every launch
constant, so the capture that the second call makes copies nothing from the host. Every buffer the
capture allocates comes from a memory pool of its own that nothing outside the graphs uses, so a replay
never writes into memory someone else holds. A replay copies its arguments into the graph's input
buffer and returns a copy of its outputs: what a caller holds (a checkpoint's KV arrays, say) is never
overwritten by a later replay. Inputs and outputs are each one buffer, so a decode step whose state
came out of the previous replay copies it in, and its new state out, as one span each. A function
that cannot be captured (it syncs with the host) runs eagerly from then on; ``failures`` says why.
"""

from __future__ import annotations

import cupy as cp

from ..backends.packing import offsets, views

_POOLS: dict[int, cp.cuda.MemoryPool] = {}  # per device: the memory every captured graph allocates from


def _graph_pool() -> cp.cuda.MemoryPool:
    device = cp.cuda.Device().id
    if device not in _POOLS:
        _POOLS[device] = cp.cuda.MemoryPool()
    return _POOLS[device]


class _Captured:
    """One captured graph. Its inputs and its outputs each live in one buffer, laid out by
    :func:`ds4lab.backends.packing.offsets`: a run of arguments that sits in one buffer at those relative
    offsets (a replay's outputs, CuPy's packed upload) is copied in as one span, and the outputs leave
    as one copy whose views are returned."""

    def __init__(self, fn, args):
        in_offs, size = offsets(a.nbytes for a in args)
        self.in_offs = in_offs
        self.in_buf = cp.empty(size, dtype=cp.uint8)
        self.inputs = views(self.in_buf, args, in_offs)
        for dst, src in zip(self.inputs, args):
            dst[...] = src
        stream = cp.cuda.Stream(non_blocking=True)  # the legacy stream cannot be captured
        pool = _graph_pool()
        with cp.cuda.using_allocator(pool.malloc), stream:
            stream.begin_capture()
            try:
                outputs = fn(*self.inputs)
                out_offs, out_size = offsets(o.nbytes for o in outputs)
                self.out_buf = cp.empty(out_size, dtype=cp.uint8)
                self.outputs = views(self.out_buf, outputs, out_offs)
                for dst, src in zip(self.outputs, outputs):
                    dst[...] = src
            finally:
                self.graph = stream.end_capture()
        self.out_offs = out_offs

    def _copy_in(self, args, stream) -> None:
        i, n = 0, len(args)
        while i < n:  # the longest run from i that sits in one buffer at the input layout's offsets
            j, mem, base = i + 1, args[i].data.mem, args[i].data.ptr - self.in_offs[i]
            while j < n and args[j].data.mem is mem and args[j].data.ptr - self.in_offs[j] == base:
                j += 1
            end = self.in_offs[j - 1] + args[j - 1].nbytes
            dst = self.in_buf.data + self.in_offs[i]
            dst.copy_from_device_async(args[i].data, end - self.in_offs[i], stream)
            i = j

    def __call__(self, args):
        stream = cp.cuda.get_current_stream()
        self._copy_in(args, stream)
        self.graph.launch(stream)
        out = cp.empty_like(self.out_buf)
        out.data.copy_from_device_async(self.out_buf.data, self.out_buf.nbytes, stream)
        return tuple(views(out, self.outputs, self.out_offs))


class GraphStep:
    """``fn(*arrays) -> tuple of arrays`` (arrays on the current device), replayed as a CUDA graph."""

    def __init__(self, fn):
        self.fn = fn
        self._graphs: dict[tuple, _Captured] = {}
        self._ran: set[tuple] = set()
        self.failures: dict[tuple, str] = {}
        self.captures = 0

    def __call__(self, *args):
        args = [a if a.flags.c_contiguous else cp.ascontiguousarray(a) for a in args]  # it makes 0-d 1-d
        key = (cp.cuda.Device().id, *((a.shape, a.dtype.str) for a in args))
        if key in self._graphs:
            return self._graphs[key](args)
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
