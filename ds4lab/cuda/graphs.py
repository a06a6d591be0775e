"""CUDA graphs for CuPy: a function of device arrays captured once per set of shapes and replayed.

A decode step is a few hundred small launches per layer; launched one by one from Python, the host is
the bottleneck (milliseconds per layer against microseconds of GPU work). Replaying a captured graph
launches all of them at once.

The first call with a set of shapes runs eagerly: it compiles the kernels and makes every launch
constant, so the capture that the second call makes copies nothing from the host; the graph holds the
launch plans it reads, which the launchers' caches may later drop (:func:`ds4lab.mlx_kernels.launches.holding`).
Every buffer the capture allocates comes from a memory pool of its own that nothing outside the graphs
uses, so a replay never writes into memory someone else holds. A replay copies its arguments into the graph's input
buffer (but see ``carry`` below) and returns a copy of its outputs: what a caller holds (a checkpoint's KV arrays,
say) is never overwritten by a later replay. Inputs and outputs are each one buffer, so a run of arguments that
came out of one replay is copied in as one span, and the outputs leave in one copy per run; the outputs are
:class:`Outputs`, whose arrays are made only when read, and a slice of them (a :class:`Span`) is passed
to the next replay whole, so the host makes no array object per state array and step. A function that
cannot be captured (it syncs with the host) runs eagerly from then on; ``failures`` says why.

The state a step carries (``carry=(i, j)``: outputs j… are the next values of inputs i…) stays in the graph's input
buffer: inside the capture those inputs are the graph's own copies, so ops may write them in place
(:func:`donated`: the chunk's rows into the KV ring and the compressed rows, no pass over the rows kept), and the
carried outputs that are new arrays land back in their inputs' places at the end of the step. A replay given the
previous replay's carried outputs (the :class:`Span` of them) finds them there and copies nothing in; the caller
still gets its own copy of the new state. The outputs reach their places through one launch (``copy_spans``).
Graphs of one family (a decode step's, one per set of compressor windows it ends) share that input buffer, so a
step that switches graphs finds the state in place too: no copy of it at the switch, and one copy of it in memory.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

import cupy as cp
import numpy as np

from ..backends.packing import offsets, pieces, stale_rows, view_at, views
from ..mlx_kernels.launches import InPlaceError, holding
from .driver import GraphExec

_POOLS: dict[int, cp.cuda.MemoryPool] = {}  # per device: the memory every captured graph allocates from
_capturing = threading.local()  # .carried: {pointer: array} of the carried inputs of the capture in progress

# Spans of bytes copied by one launch: a block row per span, 16 bytes a thread, the last bytes one by one (every
# span starts 16-byte aligned: arrays of the pools and of the packed buffers are).
_COPY_SPANS = r"""
extern "C" __global__ void copy_spans(const unsigned long long* table, int n, unsigned long long dst_base) {
    // table [3, n] (n its row stride; the grid's y the spans copied): source addresses, destination addresses (from
    // dst_base), byte counts
    const char* src = (const char*)table[blockIdx.y];
    char* dst = (char*)(dst_base + table[n + blockIdx.y]);
    unsigned long long bytes = table[2 * n + blockIdx.y], words = bytes / 16;
    unsigned long long k = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long w = k; w < words; w += stride) ((uint4*)dst)[w] = ((const uint4*)src)[w];
    if (k < bytes - words * 16) dst[words * 16 + k] = src[words * 16 + k];
}
"""
COPY_THREADS, COPY_MAX_BLOCKS = 256, 512
# The live rows' copy (_LiveCopy): pieces of 64 KB, four work-groups a piece (four 16-byte words a thread), at most
# 8,192 pieces (past that the pieces grow, so the grid's rows stay under CUDA's 65,535)
COPY_PIECE, COPY_PIECE_BLOCKS, COPY_MAX_PIECES = 65536, 4, 8192
# Kept for the process: the graphs launch its function, and a RawKernel that is collected unloads its module.
_COPY_KERNEL = cp.RawKernel(_COPY_SPANS, "copy_spans")


class CarryError(ValueError):
    """A step's outputs do not match the ``carry`` it was made with (a caller's mistake, raised, not run eagerly)."""


def donated(x) -> bool:
    """Whether ``x`` is a carried input of the graph being captured on this thread: the graph's own copy of a state
    array, which an op may write in place."""
    carried = getattr(_capturing, "carried", None)
    if not carried:
        return False
    a = carried.get(getattr(getattr(x, "data", None), "ptr", None))
    return a is not None and a.shape == x.shape and a.dtype == x.dtype


def _copy_spans(pairs, stream):
    """Copy each ``(source, destination)`` array pair (of equal bytes, 16-byte aligned) in one launch on ``stream``;
    returns the launch's table of addresses and its host copy, which the caller uploads (into the table, once a
    capture is over) and keeps."""
    host = np.array([[s.data.ptr for s, _ in pairs], [d.data.ptr for _, d in pairs], [s.nbytes for s, _ in pairs]],
                    dtype=np.uint64)
    # Not from the graphs' pool: there it could take the memory of an array the capture has freed, which the graph's
    # kernels still write at every replay.
    with cp.cuda.using_allocator(cp.get_default_memory_pool().malloc):
        table = cp.empty(host.shape, dtype=cp.uint64)
    blocks = min(COPY_MAX_BLOCKS, max(1, -(-max(int(b) for b in host[2]) // (16 * COPY_THREADS))))
    with stream:
        _COPY_KERNEL((blocks, len(pairs)), (COPY_THREADS,), (table, np.int32(len(pairs)), np.uint64(0)))
    return table, host


class _LiveCopy:
    """A replay's copy of the carried state's live rows into its outputs (GraphStep's ``live``; into a recycled
    buffer, only those of them it lacks: :class:`_Recycled`), two ranges an array at most: the spans cut
    into pieces of COPY_PIECE bytes on the host each replay (:func:`ds4lab.backends.packing.pieces`), so that one
    ``copy_spans`` launch gives every piece the same few work-groups (a grid sized for the largest span left most of
    its work-groups idle: at 4K, 229 spans, the largest 2.1 MB); the table uploaded through pinned memory (two
    slots, each taken again once its copy has run), the destinations from the outputs' buffer."""

    def __init__(self, carried, offsets):
        self.src, self.dst = [a.data.ptr for a in carried], list(offsets)
        self.whole = [a.nbytes for a in carried]
        self.row_bytes = [a.nbytes // a.shape[0] if a.ndim and a.shape[0] else a.nbytes for a in carried]
        # the tables' room: pieces() makes at most this many, since a ring's window takes two spans where it wraps
        self.cap = cap = max(COPY_MAX_PIECES, 2 * len(carried))
        self.host = [np.frombuffer(cp.cuda.alloc_pinned_memory(24 * cap), np.uint64, 3 * cap) for _ in range(2)]
        with cp.cuda.using_allocator(cp.get_default_memory_pool().malloc):  # not the graphs' pool (_copy_spans)
            self.table = [cp.empty(3 * cap, dtype=cp.uint64) for _ in range(2)]
        self.done, self.turn = [None, None], 0

    def launch(self, out, rows, stream) -> None:
        slot, self.turn = self.turn, self.turn ^ 1
        if self.done[slot] is not None:
            self.done[slot].synchronize()  # its table's last copy has run (a replay ago: done long since)
        spans = []
        for k, ranges in enumerate(rows):
            rb = self.row_bytes[k]
            whole = ranges is None or rb % 16  # copy_spans copies 16-byte words from 16-byte aligned spans
            for off, nbytes in ((0, self.whole[k]),) if whole else ((a * rb, (b - a) * rb) for a, b in ranges):
                if nbytes:
                    spans.append((self.src[k] + off, self.dst[k] + off, nbytes))
        if not spans:
            return
        table, size = pieces(spans, COPY_PIECE, self.cap)
        m = table.shape[1]
        host = self.host[slot][:3 * m]
        host.reshape(3, m)[...] = table
        self.table[slot].data.copy_from_host_async(host.ctypes.data, host.nbytes, stream)
        with stream:
            _COPY_KERNEL((size // COPY_PIECE * COPY_PIECE_BLOCKS, m), (COPY_THREADS,),
                         (self.table[slot], np.int32(m), np.uint64(out.data.ptr)))
        self.done[slot] = cp.cuda.Event(disable_timing=True)
        self.done[slot].record(stream)


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


class _Lent:
    """What a lent output buffer's memory holds (cupy's UnownedMemory keeps its owner): it dies with the last array
    over the buffer, and its finalizer hands the buffer back."""

    __slots__ = ("__weakref__",)


class _Filled:
    """A family's output buffer, and what it holds: the carried arrays' ``live`` rows as the input buffer held them
    after replay ``tick``."""

    __slots__ = ("buf", "signature", "tick", "live")

    def __init__(self, buf, signature, tick, live):
        self.buf, self.signature, self.tick, self.live = buf, signature, tick, live


class _Recycled:
    """The output buffers of a family's replays, handed back once nothing holds them (no :class:`Outputs`, no view),
    and what each holds: a replay that takes one back copies into it only the live rows it does not hold as they are
    now (:func:`ds4lab.backends.packing.stale_rows`), not every live row. A decode step writes a ring slot and at
    most a compressed row a layer, where the live rows at 32K are about 20 MB a ratio-4 layer. ``tick`` counts the
    replays that moved the input buffer's state on; ``log`` holds the rows each of the last ones wrote (the
    caller's ``written``); a state copied in from elsewhere is a tick with no log, which no buffer filled before it
    reuses its rows across."""

    LOG = 8  # replays' writes remembered: a buffer back after more replays than this is filled whole

    def __init__(self):
        # spare: the buffer last handed back (a decode loop hands back one a step, the state of two steps back, and
        # takes it the next step; one it replaces goes back to CuPy's pool, which held such memory before)
        self.tick, self.log, self.spare = 0, {}, None

    def replaced(self) -> None:
        self.tick += 1

    def moved(self, written) -> None:
        self.tick += 1
        self.log[self.tick] = written
        self.log.pop(self.tick - self.LOG, None)

    def take(self, layout: _Layout, live):
        """An output buffer for a replay that has just moved the state on, lent (its memory held by a :class:`_Lent`),
        and the row ranges of each carried array to copy into it."""
        filled, self.spare = self.spare, None
        if filled is None or filled.signature != layout.signature:
            filled = None  # another layout's goes back to the pool before this one is made
            buf, rows = cp.empty(layout.size, dtype=cp.uint8), live
        else:
            buf, rows = filled.buf, self._stale(filled, live)
        lent = _Lent()
        weakref.finalize(lent, self._back, _Filled(buf, layout.signature, self.tick, live)).atexit = False
        mem = cp.cuda.UnownedMemory(buf.data.ptr, buf.nbytes, lent, buf.device.id)
        return cp.ndarray(buf.shape, cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0)), rows

    def _stale(self, filled: _Filled, live) -> list:
        ticks = range(filled.tick + 1, self.tick + 1)
        if any(self.log.get(t) is None for t in ticks):
            return live
        rows = [stale_rows(r, then, [self.log[t][k] for t in ticks])
                for k, (r, then) in enumerate(zip(live, filled.live))]
        # at most two ranges an array, as live's: the copy's table is sized for those
        return [s if s is None or len(s) <= 2 else r for s, r in zip(rows, live)]

    def _back(self, filled: _Filled) -> None:
        self.spare = filled


class _Inputs:
    """A graph's input buffer, laid out by a :class:`_Layout`, which the graphs of a family share; ``last`` (a weak
    reference) names the replay's outputs whose carried state the buffer holds, None where it holds no one's."""

    def __init__(self, layout: _Layout):
        self.offs = layout.offs
        self.buf = cp.empty(layout.size, dtype=cp.uint8)
        self.last = None
        self.recycled = _Recycled()


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
    in one copy per run (the carried state from the input buffer, the rest from the output buffer).
    ``carry``: (first carried input, first carried output, how many); ``ins``: its input buffer (:class:`_Inputs`)."""

    def __init__(self, fn, args, carry: tuple[int, int, int] | None, ins: _Inputs):
        self.ins, self.in_offs, self.in_buf = ins, ins.offs, ins.buf
        ins.last = None  # the copy below replaces whatever state the buffer held
        self.inputs = views(self.in_buf, args, self.in_offs)
        for dst, src in zip(self.inputs, args):
            dst[...] = src
        self.carry = carry
        carried = self.inputs[carry[0]:] if carry else []
        stream = cp.cuda.Stream(non_blocking=True)  # the legacy stream cannot be captured
        pool = _graph_pool()
        with cp.cuda.using_allocator(pool.malloc), stream, holding() as self.held:
            _capturing.carried = {a.data.ptr: a for a in carried}
            stream.begin_capture()
            try:
                outputs = fn(*self.inputs)
                self.layout = _Layout(outputs)
                self._table, host = _copy_spans(self._destinations(outputs, carried), stream)
            finally:
                _capturing.carried = None
                self.graph = GraphExec(cp.cuda.runtime.streamEndCapture(stream.ptr))
        self._table.set(host)
        stream.synchronize()
        self._live = None  # the live rows' copy (_LiveCopy), made at the first replay given them

    def _destinations(self, outputs, carried) -> list:
        """(output, where it lands) for every output a replay copies: into the output buffer, or a carried output
        back into its input's place (none for one written there in place). The output buffer holds the outputs
        before the carried ones and those after, these moved down over the carried span."""
        offs = self.layout.offs
        if self.carry is None:
            self.span = (self.layout.size, self.layout.size)
        else:
            j, k = self.carry[1], self.carry[2]
            if len(outputs) < j + k:
                raise CarryError(f"carry: {len(outputs)} outputs, fewer than the {k} carried from output {j}")
            self.span = (offs[j], offs[j + k] if j + k < len(offs) else self.layout.size)
        start, end = self.span
        self.out_buf = cp.empty(max(start + self.layout.size - end, 1), dtype=cp.uint8)
        base, top = self.in_buf.data.ptr, self.in_buf.data.ptr + self.in_buf.nbytes
        pairs = []
        for n, o in enumerate(outputs):
            m = n - self.carry[1] if self.carry else -1
            if 0 <= m < len(carried):
                dst = carried[m]
                if (o.shape, o.dtype) != (dst.shape, dst.dtype):
                    raise CarryError(f"carry: output {n} is {o.shape} {o.dtype}, its input {dst.shape} {dst.dtype}")
                if o.data.ptr == dst.data.ptr:
                    continue  # written in place
            else:
                dst = view_at(self.out_buf, o.shape, o.dtype, offs[n] if offs[n] < start else offs[n] - (end - start))
            if self.carry and base <= o.data.ptr < top:  # an input's memory, which a copy here may overwrite first
                raise CarryError(f"carry: output {n} is an input of the graph, not in its own carried place")
            if o.data.ptr % 16 or not o.flags.c_contiguous:
                o = o.copy()
            pairs.append((o, dst))
        return pairs

    def _copy_in(self, args, stream, last) -> bool:
        """One device copy per run of arguments that sits in one buffer at the input layout's relative
        offsets (a :class:`Span` is such a run); none for the previous replay's carried outputs (``last``, a
        weak reference to them), which are in place already. Returns whether they were."""
        offs, i, run, in_place = self.in_offs, 0, None, False  # run: [source pointer, its memory, base, start, end]
        last = last() if last is not None else None
        for a in args:
            n = len(a) if type(a) is Span else 1
            if n == 0:
                continue
            if (type(a) is Span and last is not None and a.outputs is last
                    and (i, a.start, n) == self.carry):
                i += n
                in_place = True
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
        return in_place

    def _copy(self, run, stream) -> None:
        src, _, _, start, end = run
        (self.in_buf.data + start).copy_from_device_async(src, end - start, stream)

    def check_live(self, live, written) -> None:
        """``live`` and ``written`` fit this graph's carried arrays (checked before a replay moves the state on)."""
        k = self.carry[2] if self.carry else 0
        if live is not None and (len(live) != k or any(r is not None and len(r) > 2 for r in live)):
            raise CarryError(f"live: {len(live)} arrays' row ranges (two at most each) for {k} carried arrays")
        if written is not None and len(written) != k:
            raise CarryError(f"written: {len(written)} arrays' row ranges for {k} carried arrays")

    def __call__(self, args, live=None, written=None) -> Outputs:
        self.check_live(live, written)
        stream = cp.cuda.get_current_stream()
        last, self.ins.last = self.ins.last, None  # no one's state until this replay returns (it may fail)
        if not self._copy_in(args, stream, last) and self.carry:
            self.ins.recycled.replaced()
        self.graph.launch(stream)
        (start, end), size = self.span, self.layout.size
        if self.carry:
            self.ins.recycled.moved(written)
        copies_live = end > start and live is not None
        if copies_live:  # a recycled buffer, and the live rows it lacks
            out, rows = self.ins.recycled.take(self.layout, live)
        else:
            out = cp.empty(size, dtype=cp.uint8)
        if start:
            out.data.copy_from_device_async(self.out_buf.data, start, stream)
        if copies_live:
            if self._live is None:
                i, j, k = self.carry
                self._live = _LiveCopy(self.inputs[i:], [self.layout.offs[j + m] for m in range(k)])
            self._live.launch(out, rows, stream)
        elif end > start:
            (out.data + start).copy_from_device_async(self.in_buf.data + self.in_offs[self.carry[0]], end - start,
                                                      stream)
        if size > end:
            (out.data + end).copy_from_device_async(self.out_buf.data + start, size - end, stream)
        outputs = Outputs(out, self.layout)
        self.ins.last = weakref.ref(outputs) if self.carry else None
        return outputs


class GraphStep:
    """``fn(*arrays) -> tuple of arrays`` (arrays on the current device), replayed as a CUDA graph. An
    argument may be a :class:`Span` of an earlier replay's outputs, standing for its arrays (copied in as
    one span). ``carry=(i, j)``: the outputs from j on are the next values of the inputs from i on (the
    last arguments), kept in the graph's input buffer (see the module's docstring). ``family``: a mapping that
    GraphSteps sharing their input buffers hold in common (the same arguments, the same carry), by key; a
    ``weakref.WeakValueDictionary`` lets a buffer go with the last graph that uses it. A call's ``live``: for each
    carried array, the row ranges of the new state that later steps read (None for all of it,
    :func:`ds4lab.runtime.compiled.live_rows`): a replay copies only those into its outputs, the other rows of the
    outputs left as the memory held them (an eager call returns its arrays whole). A call's ``written``: for each
    carried array, the row ranges the call writes (None for any, :func:`ds4lab.runtime.compiled.written_rows`); with
    them, a replay whose outputs go into a buffer that an earlier replay's outputs held, once nothing holds those,
    copies only the live rows written since (:class:`_Recycled`)."""

    def __init__(self, fn, carry: tuple[int, int] | None = None, family=None):
        self.fn = fn
        self.carry = carry
        self._inputs = {} if family is None else family  # _Inputs by key, as _graphs
        self._graphs: dict[tuple, _Captured] = {}
        self._ran: set[tuple] = set()
        self.failures: dict[tuple, str] = {}
        self.captures = 0

    def __call__(self, *args, live=None, written=None):
        args, signature = _arguments(args)
        key = (cp.cuda.runtime.getDevice(), *signature)
        captured = self._graphs.get(key)
        if captured is not None:
            return captured(args, live, written)
        args = _flat(args)
        if key not in self._ran or key in self.failures:
            self._ran.add(key)
            return self.fn(*args)
        carry = None if self.carry is None else (*self.carry, len(args) - self.carry[0])
        try:
            ins = self._inputs.get(key) or _Inputs(_Layout(args))
            self._graphs[key] = captured = _Captured(self.fn, args, carry, ins)
            self._inputs[key] = ins  # kept from here on: a capture that fails leaves no buffer behind
        except (CarryError, InPlaceError):  # mistakes, not an uncapturable call
            raise
        except Exception as e:  # a host sync or an uncapturable call inside fn (a real bug re-raises below)
            self.failures[key] = f"{type(e).__name__}: {e}"
            return self.fn(*args)
        self.captures += 1
        return captured(args, live, written)

    def replay_seconds(self, repeats: int = 20) -> list[float]:
        """GPU seconds of one bare replay (no argument copies) of each graph captured, replayed back to back
        (a benchmark's view of the GPU work against the host's)."""
        stream, seconds = cp.cuda.get_current_stream(), []
        for captured in self._graphs.values():
            captured.ins.last = None  # the replays below move its state on: the next call copies its state in
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            for _ in range(repeats):
                captured.graph.launch(stream)
            end.record(stream)
            end.synchronize()
            seconds.append(cp.cuda.get_elapsed_time(start, end) / 1e3 / repeats)
        return seconds
