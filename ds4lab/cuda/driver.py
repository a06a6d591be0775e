"""The CUDA driver calls CuPy does not make: a stream of the device's highest priority, and a captured graph
instantiated so that its kernels keep the priority of the stream each was captured from.

A decode step's side chains (:mod:`.branches`) are short launches the main stream's next product waits for; at the
default priority a wide product launched meanwhile takes every SM first and the side chain runs after it. A graph
node keeps its stream's priority from the capture, but a replay honours it only when the graph was instantiated with
``USE_NODE_PRIORITY`` (CuPy's ``end_capture`` instantiates without flags). Through ctypes on ``libcuda``, which every
machine with an NVIDIA driver has; the handles are the runtime's (a ``CUgraph`` is a ``cudaGraph_t``).
"""

from __future__ import annotations

import ctypes
import functools
import os

import cupy as cp

USE_NODE_PRIORITY = 8  # CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY
_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING: no implicit order with the legacy stream


@functools.cache
def libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("nvcuda.dll" if os.name == "nt" else "libcuda.so.1")


def check(status: int, call: str) -> None:
    """Raise for a driver call's error status, naming the call and the error."""
    if status:
        name = ctypes.c_char_p()
        libcuda().cuGetErrorName(status, ctypes.byref(name))
        raise RuntimeError(f"{call} failed: {name.value.decode() if name.value else status}")


def high_priority_stream() -> cp.cuda.ExternalStream:
    """A new non-blocking stream of the current device's highest priority (kept by its caller for the process)."""
    context = ctypes.c_void_p()
    check(libcuda().cuCtxGetCurrent(ctypes.byref(context)), "cuCtxGetCurrent")
    if not context.value:  # a thread the runtime has not used yet: it makes the device's context current
        cp.cuda.runtime.free(0)
    least, greatest = ctypes.c_int(), ctypes.c_int()
    check(libcuda().cuCtxGetStreamPriorityRange(ctypes.byref(least), ctypes.byref(greatest)),
          "cuCtxGetStreamPriorityRange")
    handle = ctypes.c_void_p()
    check(libcuda().cuStreamCreateWithPriority(ctypes.byref(handle), _NON_BLOCKING, greatest),
          "cuStreamCreateWithPriority")
    return cp.cuda.ExternalStream(handle.value, cp.cuda.Device().id)


class GraphExec:
    """A captured graph (the runtime's handle, which this takes over and destroys) instantiated with
    ``USE_NODE_PRIORITY``; ``launch(stream)`` as CuPy's ``Graph``."""

    def __init__(self, graph: int):
        handle = ctypes.c_void_p()
        try:
            check(libcuda().cuGraphInstantiateWithFlags(ctypes.byref(handle), ctypes.c_void_p(graph),
                                                        ctypes.c_ulonglong(USE_NODE_PRIORITY)),
                  "cuGraphInstantiateWithFlags")
        finally:
            cp.cuda.runtime.graphDestroy(graph)  # the instance is a copy: the captured graph is not needed
        self.ptr = handle.value

    def launch(self, stream: cp.cuda.Stream) -> None:
        cp.cuda.runtime.graphLaunch(self.ptr, stream.ptr)

    def __del__(self):
        if getattr(self, "ptr", None):
            try:
                cp.cuda.runtime.graphExecDestroy(self.ptr)
            except Exception:  # at the process's exit the runtime may be unloaded first: nothing left to free
                pass
