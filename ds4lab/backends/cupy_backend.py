"""The CuPy backend (float32 on an NVIDIA GPU).

Weights stay on the GPU in their GGUF block form (Q8_0's regrouped into tiles) and run through ds4lab's
kernels (``kernels=True``, the default); the routed experts of a layer are uploaded whole, once, and a step
evaluates its selected experts in one launch per projection (qmatmul for a decode step, qgemm for a chunk).
With kernels, the layers of a decode step (up to ``compiled_rows`` tokens) are captured as one CUDA graph, or
per layer half where tiers split them, and replayed (see :mod:`ds4lab.cuda.graphs`); ``Runtime(..., compile=False)``
launches them op by op. ``upload`` sends a step's small host arrays in one transfer. ``kernels=False``
is the plain-ops path: every weight dequantized to float32 on the GPU and every op a CuPy array op.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import cupy as cp
import numpy as np

from . import cuda_device_label
from .base import BlockBackend
from .packing import offsets, views

UPLOAD_LAYOUTS = 16  # upload buffers kept (a decode step's layout, a few chunk lengths' ones)
# Pinned buffers kept per shape fetched (a step's logits, the token of a step launched ahead), each reused once its
# result is read: a decode launching ahead has two steps' fetches of each in flight. Shapes kept: FETCH_SHAPES, the
# least recently used dropped.
FETCH_BUFFERS = 3
FETCH_SHAPES = 8
# Weights go up in pieces, UPLOAD_THREADS at a time: each thread reads a piece of the mapped file into one of its
# two pinned buffers while the other one's copy to the GPU runs (cp.asarray of a memory-mapped tensor copies from
# pageable memory, one page fault at a time). A tensor is cut in pieces of at most PIECE_BYTES so that every
# thread gets one; one of SMALL_BYTES or less goes up in one copy. Pinned memory used: 2 x threads x piece.
PIECE_BYTES = 16 << 20
SMALL_BYTES = 64 << 20
UPLOAD_THREADS = 16


class _PinnedFetch:
    """A device array's copy into a pinned host buffer, queued on a stream; ``result()`` waits for that copy alone.
    Holds the device array until then (the copy may run on another stream than the one that made it)."""

    def __init__(self, host: np.ndarray, stream, source):
        self.host, self.event, self.value, self.source = host, cp.cuda.Event(disable_timing=True), None, source
        self.event.record(stream)

    def result(self) -> np.ndarray:
        if self.value is None:
            self.event.synchronize()
            self.value, self.source = self.host.copy(), None  # the buffer serves a later fetch
        return self.value


class CupyBackend(BlockBackend):
    name = "cupy"
    xp = cp
    dtype = cp.float32
    asynchronous = True

    def __init__(self, device: str | int | None = None, kernels: bool = True, chunk_operands: str = "float32",
                 decode_matmul: str = "float32"):
        index = 0 if device in (None, "gpu", "cuda") else int(str(device).removeprefix("cuda:"))
        if not 0 <= index < cp.cuda.runtime.getDeviceCount():
            raise ValueError(f"CUDA device {device!r} does not exist here ({cp.cuda.runtime.getDeviceCount()} GPUs)")
        self.cuda_device = cp.cuda.Device(index)
        self.cuda_device.use()
        self.device = f"cuda:{index}"
        try:  # what a run's header shows: "cuda:0 (NVIDIA H200)"
            name = cp.cuda.runtime.getDeviceProperties(index)["name"]
        except Exception:  # a runtime without the query: the index alone
            name = None
        self.device_label = cuda_device_label(index, name)
        self.use_kernels = kernels
        self.chunk_operands = chunk_operands  # prefill_matmul (see ds4lab.load)
        self.decode_matmul = decode_matmul
        self._kernels: dict[int, object] = {}  # CUDA modules are per device: one set per GPU used (tiers)
        self._uploads: dict[tuple, list] = {}  # (device, shapes and dtypes) -> two staging and device buffers, turn
        self._fetches: dict[tuple, deque] = {}  # (device, shape, dtype) -> the latest fetches, oldest first
        self._fetch_streams: dict[int, cp.cuda.Stream] = {}  # per device: the stream the fetches copy on
        self._upload_streams: dict[int, cp.cuda.Stream] = {}  # per device: the stream the uploads copy on

    def device_bytes(self, raw):
        """GGUF bytes ``raw`` (a memory-mapped host array) on the current GPU: read into pinned buffers and copied
        up by several threads at once, each thread's reads (which fault the file's pages in) overlapping its
        previous piece's copy."""
        raw = np.asarray(raw)
        out = cp.empty(raw.shape, dtype=cp.uint8)
        src = raw.reshape(-1)  # a GGUF tensor's bytes are contiguous
        n = src.nbytes
        if n <= SMALL_BYTES:
            out.set(raw)
            return out
        size = min(PIECE_BYTES, -(-n // UPLOAD_THREADS))
        # every thread's stream and buffers, kept here until the copies finish (a thread's locals go when it ends)
        device, local, streams, buffers = cp.cuda.Device(), threading.local(), [], []
        # out's memory may have been freed by work still queued on the current stream: let that finish first, since
        # the pieces are copied on streams of their own
        cp.cuda.get_current_stream().synchronize()

        def piece(start: int) -> None:
            if not hasattr(local, "slots"):
                with device:
                    stream = cp.cuda.Stream(non_blocking=True)
                    slots = [(np.frombuffer(cp.cuda.alloc_pinned_memory(size), np.uint8, size),
                              cp.cuda.Event(disable_timing=True)) for _ in range(2)]
                streams.append(stream)
                buffers.append(slots)
                local.stream, local.slots, local.turn = stream, slots, 0
            buffer, copied = local.slots[local.turn]
            local.turn ^= 1
            copied.synchronize()  # the copy that last read this buffer is done (at once if none did)
            m = min(size, n - start)
            np.copyto(buffer[:m], src[start:start + m])
            with device:
                (out.data + start).copy_from_host_async(buffer.ctypes.data, m, local.stream)
                copied.record(local.stream)

        pool = ThreadPoolExecutor(UPLOAD_THREADS)
        try:
            list(pool.map(piece, range(0, n, size)))
        finally:  # a failed piece (an out-of-memory, a read error) cancels the pieces not started; every copy under
            pool.shutdown(cancel_futures=True)  # way finishes before out or a buffer can go back to its pool
            errors = []
            for stream in streams:
                try:
                    stream.synchronize()
                except Exception as e:  # the others still must finish
                    errors.append(e)
            buffers.clear()
            if errors:
                raise errors[0]
        return out

    compiled_rows = 16  # a chunk of more rows runs eagerly: its launches are few against its GPU time
    long_prefill_chunks = True  # so chunks of 4096 pad nothing (1.13-1.14x the prefill rate of 2048 on an H100)
    compiles_ffn = True  # decode routing stays on the device, so the FFN half is a graph too

    @property
    def can_compile(self) -> bool:
        return self.use_kernels

    def compile(self, fn, carry=None, family=None):
        from ..cuda.graphs import GraphStep

        return GraphStep(fn, carry, family)

    def donated(self, x) -> bool:
        from ..cuda.graphs import donated

        return donated(x)

    def upload(self, arrays):
        """One host-to-device transfer for all of them (a step's tables, positions and ids), through a pinned
        staging buffer into a device buffer, two of each kept per device and layout and taken in turn. The arrays
        returned are one of the two sets of objects (no array is made per step), rewritten by the next upload but one
        of the same shapes: a caller enqueues its readers on the current stream before the next upload of them (a
        CUDA graph replay copies them into its own buffer first). So the copy into a half waits only for what the
        current stream held at the upload after that half's last one (its readers, and a step launched ahead), on a
        stream of its own, and the current stream's next launches wait for it: where the host runs ahead, the copy is
        done before the stream reaches its readers, and the step's stream holds an event's wait, not the copy."""
        key = (cp.cuda.runtime.getDevice(), *((a.shape, a.dtype) for a in arrays))
        slot = self._uploads.pop(key, None)
        if slot is None:
            if len(self._uploads) >= UPLOAD_LAYOUTS:  # forget the least recently used layout
                for half in self._uploads.pop(next(iter(self._uploads)))[:2]:
                    half[4].synchronize()
            host = [np.asarray(a, dtype=np.float32 if a.dtype.kind == "f" else np.int32) for a in arrays]
            offs, size = offsets(a.nbytes for a in host)

            def half():  # staging, its views, device, its views, its copy's event, its readers' event
                staging = np.frombuffer(cp.cuda.alloc_pinned_memory(size), np.uint8, size)
                device = cp.empty(size, dtype=cp.uint8)
                return (staging, views(staging, host, offs), device, views(device, host, offs), cp.cuda.Event(),
                        cp.cuda.Event(disable_timing=True))

            slot = [half(), half(), 0]
        self._uploads[key] = slot  # the most recently used last
        turn = slot[2]
        slot[2] ^= 1
        stream = cp.cuda.get_current_stream()
        slot[turn ^ 1][5].record(stream)  # the other half's readers (of the last upload) are enqueued by now
        staging, staged, device, on_device, copied, read = slot[turn]
        copied.synchronize()  # this half's last copy has left its staging buffer
        for dst, a in zip(staged, arrays):
            dst[...] = a  # cast to float32 or int32 as it is written
        upload = self._copy_stream(key[0], self._upload_streams)
        upload.wait_event(read)  # recorded at the last upload (never recorded: no wait)
        device.data.copy_from_host_async(staging.ctypes.data, staging.nbytes, upload)
        copied.record(upload)
        stream.wait_event(copied)
        return on_device

    @staticmethod
    def _copy_stream(device: int, streams: dict) -> cp.cuda.Stream:
        """The device's stream in ``streams``, made at its first use."""
        if device not in streams:
            streams[device] = cp.cuda.Stream(non_blocking=True)
        return streams[device]

    def fetch(self, x) -> _PinnedFetch:
        """``x``'s copy to a kept pinned buffer, queued now on a copy stream after what the current stream has queued
        (:meth:`Backend.fetch`)."""
        x = cp.ascontiguousarray(x)
        key = (cp.cuda.Device().id, x.shape, x.dtype.str)
        ring = self._fetches.pop(key, None)
        if ring is None:
            if len(self._fetches) >= FETCH_SHAPES:  # forget the least recently used shape, its results read first
                for old in self._fetches.pop(next(iter(self._fetches))):
                    old.result()
            ring = deque()
        self._fetches[key] = ring  # the most recently used last
        if len(ring) < FETCH_BUFFERS:
            host = np.frombuffer(cp.cuda.alloc_pinned_memory(max(x.nbytes, 1)), x.dtype, x.size).reshape(x.shape)
        else:
            oldest = ring.popleft()
            oldest.result()  # read before its buffer takes the next copy
            host = oldest.host
        # The copy waits for x on a stream of its own: the current stream's next launches (the step launched ahead)
        # do not wait for it.
        made = cp.cuda.Event(disable_timing=True)
        made.record(cp.cuda.get_current_stream())
        stream = self._copy_stream(key[0], self._fetch_streams)
        stream.wait_event(made)
        x.data.copy_to_host_async(host.ctypes.data, x.nbytes, stream)
        ring.append(_PinnedFetch(host, stream, x))
        return ring[-1]

    def device_key(self):
        return cp.cuda.Device().id

    def branch(self):
        from ..cuda.branches import Branch

        return Branch()

    @property
    def kernels(self):
        """The kernels of the current CUDA device, or None when they are switched off."""
        if not self.use_kernels:
            return None
        index = cp.cuda.Device().id
        if index not in self._kernels:
            from ..cuda import CudaKernels

            self._kernels[index] = CudaKernels(self.chunk_operands, self.decode_matmul)
        return self._kernels[index]

    def to_numpy(self, x):
        return cp.asnumpy(x)

    def synchronize(self):
        cp.cuda.get_current_stream().synchronize()
