"""CUDA graphs for CuPy: a function of device arrays captured once per set of shapes and replayed.

A decode step is a few hundred small launches per layer; launched one by one from Python, the host is
the bottleneck (milliseconds per layer against microseconds of GPU work). Replaying a captured graph
launches all of them at once.

The first call with a set of shapes runs eagerly: it compiles the kernels and makes every launch
constant, so the capture that the second call makes copies nothing from the host. Every buffer the
capture allocates comes from a memory pool of its own that nothing outside the graphs uses, so a replay
never writes into memory someone else holds. A replay copies its arguments into the graph's input
buffers and returns copies of its outputs: what a caller holds (a checkpoint's KV arrays, say) is never
overwritten by a later replay. A function that cannot be captured (it syncs with the host) runs eagerly
from then on; ``failures`` says why.
"""

from __future__ import annotations

import cupy as cp

_POOLS: dict[int, cp.cuda.MemoryPool] = {}  # per device: the memory every captured graph allocates from


def _graph_pool() -> cp.cuda.MemoryPool:
    device = cp.cuda.Device().id
    if device not in _POOLS:
        _POOLS[device] = cp.cuda.MemoryPool()
    return _POOLS[device]


class _Captured:
    def __init__(self, fn, args):
        self.inputs = [a.copy() for a in args]
        stream = cp.cuda.Stream(non_blocking=True)  # the legacy stream cannot be captured
        pool = _graph_pool()
        with cp.cuda.using_allocator(pool.malloc), stream:
            stream.begin_capture()
            try:
                self.outputs = fn(*self.inputs)
            finally:
                self.graph = stream.end_capture()

    def __call__(self, args):
        stream = cp.cuda.get_current_stream()
        for dst, src in zip(self.inputs, args):
            dst.data.copy_from_device_async(src.data, src.nbytes, stream)
        self.graph.launch(stream)
        return tuple(o.copy() for o in self.outputs)


class GraphStep:
    """``fn(*arrays) -> tuple of arrays`` (arrays on the current device), replayed as a CUDA graph."""

    def __init__(self, fn):
        self.fn = fn
        self._graphs: dict[tuple, _Captured] = {}
        self._ran: set[tuple] = set()
        self.failures: dict[tuple, str] = {}
        self.captures = 0

    def __call__(self, *args):
        args = [cp.ascontiguousarray(a) for a in args]
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
