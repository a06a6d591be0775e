"""Work that runs beside the main stream: a decode step's independent chains of small launches on side streams.

A decode step is a chain of a few thousand short launches, most of them too small to fill the GPU; some runs of
them do not depend on each other (a layer's KV row and compressors against its queries, the shared expert
against the routed ones). A :class:`Branch` is forked from the current stream where it is made: launches made
inside ``with branch:`` go to a side stream that starts after everything launched before the fork, and run beside
what the current stream launches meanwhile; ``join()`` makes the current stream wait for them. In a CUDA graph
capture the fork and the join are the graph's edges, so a replay runs the branches side by side.

Memory: CuPy's pool gives an array freed on a stream back to that stream's free list. An array the branch reads is
held by its caller until the join; one the branch makes returns, when freed, to the side stream's list, which a
later branch reuses only after its own fork, so after every launch made before it.
"""

from __future__ import annotations

import itertools
import threading

import cupy as cp

SIDE_STREAMS = 2  # per device and thread: branches made one after another take them in turn
_streams: dict[tuple, itertools.cycle] = {}


def _side_stream() -> cp.cuda.Stream:
    key = (cp.cuda.Device().id, threading.get_ident())
    if key not in _streams:
        _streams[key] = itertools.cycle([cp.cuda.Stream(non_blocking=True) for _ in range(SIDE_STREAMS)])
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

    def __enter__(self):
        self.side.__enter__()
        return self

    def __exit__(self, *exc):
        return self.side.__exit__(*exc)

    def join(self) -> None:
        _after(self.side, self.main)
