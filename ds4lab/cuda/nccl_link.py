"""Arrays moved between the GPUs of one process over NCCL (``cupy.cuda.nccl``): the link CuPy tiers on different
GPUs switch over where NCCL is installed (:func:`ds4lab.tiers.make_tiers`); without it they make peer copies.

NCCL picks the fastest path between two GPUs (NVLink, PCIe peer access, or host memory) and is what a
multi-GPU engine uses; the one process holds a communicator per GPU (``ncclCommInitAll``), so a move is a
send on the source GPU's communicator and a receive on the destination's, issued together in one group. NCCL
refuses two ranks on one GPU (two processes or two communicators), but a communicator may send to itself:
that is how one GPU exercises this path (``tests/test_gpu_tiers.py``)."""

from __future__ import annotations

import warnings
from functools import lru_cache

import cupy as cp


def nccl_available() -> bool:
    try:
        from cupy.cuda import nccl
    except ImportError:
        return False
    return bool(getattr(nccl, "available", True))


@lru_cache(maxsize=None)
def link_for(devices: tuple[int, ...]):
    """The process's :class:`NcclLink` over the GPUs ``devices`` (sorted), made once and shared by every
    placement on them; None for fewer than two GPUs, without NCCL, or where NCCL cannot start (a warning says
    why): the tiers then make peer copies."""
    if len(devices) < 2 or not nccl_available():
        return None
    try:
        return NcclLink(devices)
    except Exception as e:
        warnings.warn(f"NCCL over GPUs {list(devices)} could not start ({type(e).__name__}: {e}); tiers on them "
                      "switch with peer copies", RuntimeWarning, stacklevel=2)
        return None


class NcclLink:
    """One NCCL communicator for each GPU of ``device_ids`` in this process; :meth:`move` sends an array to one."""

    def __init__(self, device_ids):
        from cupy.cuda import nccl

        self._nccl = nccl
        self.devices = sorted(set(int(d) for d in device_ids))
        self._rank = {d: r for r, d in enumerate(self.devices)}
        self._comms = nccl.NcclCommunicator.initAll(self.devices)

    def move(self, x, device: int):
        """A copy of the CuPy array ``x`` on GPU ``device`` (one of the link's), its bytes sent by NCCL from x's
        GPU; returns once they have arrived."""
        nccl, src = self._nccl, x.device.id
        if src not in self._rank or device not in self._rank:
            raise ValueError(f"NCCL link of GPUs {self.devices}: cannot move an array from GPU {src} to GPU {device}")
        with cp.cuda.Device(src):
            x = cp.ascontiguousarray(x)
            send_stream = cp.cuda.get_current_stream()
        with cp.cuda.Device(device):
            y = cp.empty(x.shape, x.dtype)
            recv_stream = cp.cuda.get_current_stream()
        nccl.groupStart()
        try:
            self._comms[self._rank[src]].send(x.data.ptr, x.nbytes, nccl.NCCL_UINT8, self._rank[device],
                                              send_stream.ptr)
            self._comms[self._rank[device]].recv(y.data.ptr, y.nbytes, nccl.NCCL_UINT8, self._rank[src],
                                                 recv_stream.ptr)
        finally:
            nccl.groupEnd()
        recv_stream.synchronize()
        return y
