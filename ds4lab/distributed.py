"""Tiers on the ranks of an ``mx.distributed`` group: the model's layers split into pipeline stages over
processes (on one host or several), every process running the same script as ``mlx.launch`` starts it.

A tier ``"rank:N"`` (:class:`RankTier`) runs its units in the process of rank N; the other processes skip
them and keep none of their KV state. A switch to a tier on another rank sends the hidden state with the
group's ``send``/``recv`` (:meth:`Ranks.move`): one token's n_hc × n_embd floats in decode, the chunk's rows
in batch. MLX's ring backend sends only between neighbours on its ring (rank r and r ± 1 mod size), so an
array for a farther rank is relayed by the ranks between, the shorter way round; every rank calls every move
in the same order (SPMD), which is what keeps the ranks in step. The head's logits reach every rank
(:meth:`Ranks.share`), so every process samples the same token from the same bits.

A rank that dies closes its sockets: the ranks waiting on it get ``[ring] connection to a peer was lost``
from MLX at once, raised here as a :class:`LinkError` that names both ranks and what was moving; they exit
in turn, and the failure runs along the ring.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import mlx.core as mx
import numpy as np


class LinkError(RuntimeError):
    """A send or receive between ranks failed: a peer has stopped (killed, or failed before this step)."""


class Ranks:
    """The processes of an ``mx.distributed`` group (the global one by default) and the arrays moved between
    them. Sends and receives run on the CPU stream (the ring backend's; on a Mac the memory is shared)."""

    def __init__(self, group=None):
        self.group = mx.distributed.init() if group is None else group
        self.rank, self.size = self.group.rank(), self.group.size()

    def __repr__(self) -> str:
        return f"Ranks(rank {self.rank} of {self.size})"

    def path(self, src: int, dst: int) -> list[int]:
        """The ranks an array passes from ``src`` to ``dst``: neighbours on the ring, the shorter way round."""
        forward = (dst - src) % self.size
        step = 1 if forward <= self.size - forward else -1
        out = [src]
        while out[-1] != dst:
            out.append((out[-1] + step) % self.size)
        return out

    def move(self, x, src: int, dst: int, shape: tuple, dtype, what: str):
        """Move ``x`` (held by rank ``src``; None elsewhere) to rank ``dst``. Every rank calls it; returns
        ``(x on dst, None elsewhere; this rank's seconds sending and receiving)``."""
        path = self.path(src, dst)
        if self.rank not in path or src == dst:
            return (x if self.rank == dst else None), 0.0
        began = time.perf_counter()
        at = path.index(self.rank)
        if at > 0:
            x = self._recv(shape, dtype, path[at - 1], what)
        if at < len(path) - 1:
            self._send(x, path[at + 1], what)
        return (x if self.rank == dst else None), time.perf_counter() - began

    def share(self, x, root: int, shape: tuple, dtype, what: str):
        """``x`` of rank ``root`` on every rank, passed along the ring from the root (size − 1 sends)."""
        prev, nxt = (self.rank - 1) % self.size, (self.rank + 1) % self.size
        if self.rank != root:
            x = self._recv(shape, dtype, prev, what)
        if nxt != root:
            self._send(x, nxt, what)
        return x

    def share_bytes(self, data: bytes | None, root: int, what: str) -> bytes:
        """Bytes of rank ``root`` (``data`` there, None elsewhere) on every rank: their length, then them."""
        n = int(self.share(mx.array([len(data) if self.rank == root else 0], dtype=mx.int64), root, (1,),
                           mx.int64, what).item())
        if n == 0:
            return b""
        arr = mx.array(np.frombuffer(data, dtype=np.uint8)) if self.rank == root else None
        return bytes(np.array(self.share(arr, root, (n,), mx.uint8, what)))

    def _send(self, x, dst: int, what: str) -> None:
        self._eval(mx.distributed.send(x, dst, group=self.group, stream=mx.cpu), dst, what)

    def _recv(self, shape, dtype, src: int, what: str):
        y = mx.distributed.recv(tuple(shape), dtype, src, group=self.group, stream=mx.cpu)
        self._eval(y, src, what)
        return y

    def _eval(self, x, peer: int, what: str) -> None:
        try:
            mx.eval(x)
        except RuntimeError as e:
            raise LinkError(f"rank {self.rank}: {what}: the link with rank {peer} failed ({e}); a rank of the "
                            f"group has stopped (killed, or failed before this step)") from e


class RankTier:
    """Tier ``"rank:N"``: its units run in the process of rank N, on that process's default device; the
    other processes keep none of its layers' state (:meth:`adopt` gives them None)."""

    def __init__(self, device: str, backend, ranks: Ranks):
        try:
            self.rank = int(device.removeprefix("rank:"))
        except ValueError:
            raise ValueError(f"unknown rank tier {device!r}; use 'rank:N'") from None
        if not 0 <= self.rank < ranks.size:
            raise ValueError(f"tier {device!r}: the group has {ranks.size} rank(s), 0…{ranks.size - 1}; start "
                             f"every rank with mlx.launch (docs/DISTRIBUTED.md)")
        self.device, self.backend, self.ranks = device, backend, ranks

    @property
    def here(self) -> bool:
        """Whether this process is the tier's rank."""
        return self.rank == self.ranks.rank

    def adopt(self, x):
        return x if self.here else None

    def settle(self, x):
        self.backend.eval(x)

    def scope(self):
        return nullcontext()


def rank_tiers(backend, devices, group=None) -> tuple[RankTier, ...]:
    """The tiers of ``devices`` (every one ``"rank:N"``) over ``group``'s ranks; MLX only (mx.distributed)."""
    if backend.name != "mlx":
        raise ValueError(f"rank tiers ({', '.join(devices)}) move arrays with mx.distributed: they need the mlx "
                         f"backend, not {backend.name}")
    ranks = Ranks(group)
    return tuple(RankTier(d, backend, ranks) for d in devices)
