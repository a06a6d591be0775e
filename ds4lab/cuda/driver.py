"""The CUDA driver calls CuPy does not make: a stream of the device's highest priority, a captured graph
instantiated so that its kernels keep the priority of the stream each was captured from, and a kernel launch that
lets the next one start before it ends.

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
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_PTX_VERSION, _BINARY_VERSION = 5, 6  # CU_FUNC_ATTRIBUTE_{PTX,BINARY}_VERSION: a function's virtual and real
# architecture, 10·major + minor


class LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute``: an id, then its value (a union of 64 bytes, 8-byte aligned) at offset 8."""
    _fields_ = [("id", ctypes.c_int), ("_pad", ctypes.c_char * 4), ("value", ctypes.c_uint64 * 8)]


class LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig`` of ``cuLaunchKernelEx``."""
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(LaunchAttribute)), ("n_attrs", ctypes.c_uint)]


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


@functools.cache
def _programmatic(function_ptr: int) -> bool:
    """Whether a loaded function's code is for compute capability 9.0 on, its PTX too: only there does its
    grid_dependency_wait() hold the wait (dialects.py: ``__CUDA_ARCH__`` ≥ 900), so only there may it be a
    programmatic launch."""
    versions = []
    for attribute in (_PTX_VERSION, _BINARY_VERSION):
        value = ctypes.c_int()
        check(libcuda().cuFuncGetAttribute(ctypes.byref(value), attribute, ctypes.c_void_p(function_ptr)),
              "cuFuncGetAttribute")
        versions.append(value.value)
    return min(versions) >= 90


# False: every kernel launched as usual, starting once the one before it has ended, so that a profile's kernel times
# are the kernels' own, not also their waits for the one before (benchmarks/kernel_profile.py --no-programmatic)
PROGRAMMATIC = True

_ALLOW_EARLY_START = LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
_ALLOW_EARLY_START.value[0] = 1  # programmaticStreamSerializationAllowed, an int at the union's start


def launch(function, grid: tuple, threads: int, args) -> None:
    """Launch CuPy's RawKernel ``function`` on the current stream, its arguments the device arrays ``args`` (every
    parameter a pointer). Where its code is for compute capability 9.0 on, as a programmatic dependent launch: it may
    be launched as the kernel before it on the stream ends, before that kernel's writes are flushed, and waits for
    them at ``grid_dependency_wait()`` (dialects.py: at the top of the kernel, or where its body places it after
    reading only what no kernel writes). What it saves is the gap between two kernels of a chain (in a captured graph
    too: a programmatic edge). Elsewhere CuPy launches it as usual."""
    ptr = function.kernel.ptr
    if not (PROGRAMMATIC and _programmatic(ptr)):
        function(grid, (threads,), args)
        return
    pointers = (ctypes.c_void_p * len(args))(*(a.data.ptr for a in args))
    base, size = ctypes.addressof(pointers), ctypes.sizeof(ctypes.c_void_p)
    params = (ctypes.c_void_p * len(args))(*(base + i * size for i in range(len(args))))
    config = LaunchConfig((ctypes.c_uint * 3)(*(*grid, 1, 1)[:3]), (ctypes.c_uint * 3)(threads, 1, 1), 0,
                          cp.cuda.get_current_stream().ptr, ctypes.pointer(_ALLOW_EARLY_START), 1)
    check(libcuda().cuLaunchKernelEx(ctypes.byref(config), ctypes.c_void_p(ptr), params, None),
          "cuLaunchKernelEx")
