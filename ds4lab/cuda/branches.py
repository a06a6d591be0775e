"""Work that runs beside the main stream: a decode step's independent chains of small launches on side streams.

A decode step is a chain of a few thousand short launches, most of them too small to fill the GPU; some runs of
them do not depend on each other (a layer's KV row and compressors against its queries, the shared expert
against the routed ones). A :class:`Branch` is forked from the current stream where it is made: launches made
inside ``with branch:`` go to a side stream that starts after everything launched before the fork, and run beside
what the current stream launches meanwhile; ``join()`` makes the current stream wait for them. In a CUDA graph
capture the fork and the join are the graph's edges, so a replay runs the branches side by side.

Memory: CuPy's pool gives an array freed on a stream back to that stream's free list, and a later allocation on that
stream may reuse it at once. So a branch's caller holds what the branch reads until the join; and an array the branch
made must not be read on the current stream and then freed while the branch is open (between its fork and its last
``with``): the branch could reuse the memory under that read. The model's branches read only what was made before
their fork or, in a branch ordered ``after()`` another, what that one made before the call (held by the model until
all have joined, and made by a branch that launches nothing more), and the current stream reads their results only
after the join.

Priority: the side streams have the device's highest priority, and a captured graph keeps it per kernel
(:mod:`.driver`): a side chain's short launches take SMs as the main stream's wide product frees them (the H200's
trace: the KV chain beside attn_q_b, not after it), so the chain's length rather than its wait decides when the
attention can start.

Uploads: CuPy copies a host array to the device on the current stream, asynchronously. A kept launch constant made
while a branch is open may be read first on another stream, so :func:`open_branches` tells the launcher to wait for
such an upload (``ds4lab.cuda.kernels``); a capture makes none (its eager call made them).
"""

from __future__ import annotations

import itertools
import threading

import cupy as cp

from .driver import high_priority_stream

SIDE_STREAMS = 6  # per device and thread: branches made one after another take them in turn (a ratio-4 layer's
# attention opens five at once: the mixer's matrix, the raw ring's, the compressors', the indexer's compressor's,
# the indexer's queries')
_streams: dict[tuple, itertools.cycle] = {}
_open = threading.local()  # .count: this thread's branches made and not yet joined


def open_branches() -> int:
    """How many branches this thread has made and not yet joined."""
    return getattr(_open, "count", 0)


def _side_stream() -> cp.cuda.Stream:
    key = (cp.cuda.Device().id, threading.get_ident())
    if key not in _streams:
        _streams[key] = itertools.cycle([high_priority_stream() for _ in range(SIDE_STREAMS)])
    return next(_streams[key])


def _after(stream: cp.cuda.Stream, waiter: cp.cuda.Stream) -> None:
    """``waiter`` runs what it is given next only after what ``stream`` was given so far."""
    event = cp.cuda.Event(block=False, disable_timing=True)
    event.record(stream)
    waiter.wait_event(event)


class Branch:
    """Launches made inside ``with branch:`` (one or several times) run on a side stream, after what the current
    stream had been given when the branch was made; ``join()`` orders the current stream after them."""

    def __init__(self):
        self.main = cp.cuda.get_current_stream()
        self.side = _side_stream()
        _after(self.main, self.side)
        self.joined = False
        _open.count = open_branches() + 1

    def __enter__(self):
        self.side.__enter__()
        return self

    def __exit__(self, *exc):
        return self.side.__exit__(*exc)

    def after(self, other: "Branch") -> None:
        """Order the branch's next launches after what ``other`` (another branch) was given so far."""
        _after(other.side, self.side)

    def join(self) -> None:
        """Order the current stream after the branch's launches (again after more of them: joined twice is fine)."""
        _after(self.side, self.main)
        if not self.joined:
            self.joined = True
            _open.count = open_branches() - 1
