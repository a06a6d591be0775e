"""Weights kept on the device in their GGUF block form (some types' regrouped into tiles: ds4lab.mlx_kernels.layout),
for backends with ds4lab's kernels: :class:`BlockLinear` (one matrix), :class:`StackedBlockLinear` (the experts
of a routed-expert tensor, the groups of attn_output_a) and :class:`BlockEmbedding` (the token embedding).

A few rows (a decode step) go through ``qmatmul`` (F32 weights too, so a decode step calls no BLAS and
can be captured as a CUDA graph), which decodes each weight row once per batch of up to
eight rows of x. A chunk's routed experts go through ``qgemm``: every (token, expert) pair of a projection
in one tiled launch that decodes the blocks into shared memory, with no dequantized copy of any weight. A
chunk through a dense linear dequantizes the matrix into a transient float32 buffer (float16 for half-operand
products) and uses the library's GEMM, unless ``BlockLinear.qgemm_chunks`` sends it through ``qgemm`` too.
Nothing dequantized is kept (but a token embedding of a type no kernel decodes, decoded once where a compiled
step looks rows up on the device).
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q

from ..mlx_kernels.launches import Columns
from ..mlx_kernels.specs import DECODERS
from ..quants import dequantize

KERNEL_MAX_ROWS = 16  # up to this many rows of x (or pairs), qmatmul; beyond, qgemm or dequantize + GEMM
KERNEL_TYPES = frozenset(DECODERS)  # the GGUF types the kernels read straight from their blocks
EMBED_HOST_ROWS = 16  # up to this many tokens, eager steps decode embedding rows on the host (graphs: on the GPU)


class BlockLinear:
    """``x -> x @ Wᵀ`` for ``W`` = ``raw [rows, row_bytes]`` (device bytes) of ``qtype``, rows of ``ne0``."""

    qgemm_chunks = False  # chunks through qgemm instead of dequantize + GEMM (a benchmark's switch)

    def __init__(self, kernels, raw, qtype: Q, ne0: int, n_rows: int):
        self.kernels, self.raw, self.qtype, self.ne0, self.n_rows = kernels, raw, Q(qtype), ne0, n_rows

    def __call__(self, x):
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.ne0)
        if x2.shape[0] <= KERNEL_MAX_ROWS:
            out = self.kernels.qmatmul(x2, self.raw, self.qtype, self.ne0, self.n_rows)
        elif self.qgemm_chunks:
            out = self.kernels.qgemm(x2, self.raw, self.qtype, self.ne0, self.n_rows)
        elif self.qtype == Q.F32:  # already floats: the bytes are the matrix
            out = self.kernels.dense_product(x2, self.raw.view(self.kernels.xp.float32).reshape(self.n_rows, self.ne0))
        else:
            out = self.kernels.dense_product(x2, self.kernels.chunk_weight(self.raw, self.qtype, self.ne0, self.n_rows))
        return out.reshape(tuple(lead) + (self.n_rows,))

    def split_sums(self, x):
        """The product of ``x [T, ne0]`` as its K splits' sums ``[S, T, rows]`` for a kernel that adds them as it
        reads them (a decode step's qmatmul, whose splits would take a launch of their own to add), or ``[1, T,
        rows]``."""
        if x.shape[0] <= KERNEL_MAX_ROWS:
            return self.kernels.qmatmul(x, self.raw, self.qtype, self.ne0, self.n_rows, reduce=False)
        return self(x)[None]

    def split_columns(self, x, bounds: list[int]) -> list:
        """The product of ``x [T, ne0]`` cut at ``bounds`` (columns ``bounds[i]:bounds[i + 1]``, a stacked product's
        tensors): for a decode step's few rows :class:`~ds4lab.mlx_kernels.launches.Columns` of its K splits, which
        the kernels that read them add (rmsnorm, rmsnorm_rope); for a chunk, views of the product."""
        if x.shape[0] <= KERNEL_MAX_ROWS:
            parts = self.split_sums(x)
            return [Columns(parts, lo, hi) for lo, hi in zip(bounds, bounds[1:])]
        y = self(x)
        return [y[..., lo:hi] for lo, hi in zip(bounds, bounds[1:])]


class StackedBlockLinear:
    """All experts of one routed-expert tensor ``raw [n_expert, rows, row_bytes]`` on the device.

    ``stacked(x, experts, repeat)`` gives row p // repeat of ``x`` times expert ``experts[p]``ᵀ for every pair
    p in one launch: qmatmul for a few pairs, qgemm for a chunk's; both read each row of x for its ``repeat``
    pairs (a token's k experts), never a repeated copy."""

    def __init__(self, kernels, raw, qtype: Q, ne0: int, n_rows: int):
        self.kernels, self.raw, self.qtype, self.ne0, self.n_rows = kernels, raw, Q(qtype), ne0, n_rows

    def __call__(self, x, experts, repeat: int = 1):
        """``experts``: host ids, or a device array of them (the routing of a step of up to DEVICE_ROUTING_ROWS
        tokens, which never leaves the device: qmatmul reads them as they are, a pair each)."""
        return self._product(x, experts, repeat, reduce=True)

    def split_sums(self, x, experts, repeat: int = 1):
        """The same product as its K splits' sums ``[S, P, rows]`` (see :meth:`BlockLinear.split_sums`)."""
        return self._product(x, experts, repeat, reduce=False)

    def _product(self, x, experts, repeat: int, reduce: bool):
        if x.shape[0] * repeat > KERNEL_MAX_ROWS and self.kernels.on_host(experts):
            out = self.kernels.qgemm(x, self.raw, self.qtype, self.ne0, self.n_rows, experts, repeat)
            return out if reduce else out[None]
        return self.kernels.qmatmul(x, self.raw, self.qtype, self.ne0, self.n_rows, experts, repeat, reduce=reduce)

    def grouped(self, x):
        """``x [T, n, ne0]``: row t of group g times matrix g, as ``[T, n · rows]`` in group order (a chunk's
        attn_output_a: every matrix dequantized, then one batched GEMM)."""
        return self.kernels.grouped_product(x, self.raw, self.qtype, self.ne0, self.n_rows)


class BlockEmbedding:
    """``tokens -> rows`` of the token embedding for a backend with kernels: a chunk's rows gathered from the table's
    GGUF bytes on the device (uploaded on first use) and decoded there: the host's dequantize and upload of a
    chunk's rows left the GPU idle. A few tokens take ``host``, unless their ids are
    on the device already (:meth:`on_device`: a compiled step's). A type with no kernel decoder is decoded
    whole, once, into a float32 table on the device."""

    def __init__(self, backend, raw, qtype: Q, ne0: int, host):
        self.backend, self.kernels, self.raw, self.qtype, self.ne0, self.host = (
            backend, backend.kernels, raw, Q(qtype), ne0, host)
        self.table = None

    def __call__(self, tokens):
        if len(tokens) <= EMBED_HOST_ROWS:
            return self.host(tokens)
        return self.on_device(self.kernels._array(np.asarray(tokens, dtype=np.int32)))

    def on_device(self, ids):
        """Rows of device int32 ``ids``."""
        blocks = self.qtype in KERNEL_TYPES
        if self.table is None:
            self.table = (self.backend.block_bytes(self.raw, self.qtype) if blocks
                          else self.backend.asarray(dequantize(self.raw, self.qtype, self.ne0)))
        rows = self.table[ids]
        return self.kernels.dequant(rows, self.qtype, self.ne0, ids.shape[0]) if blocks else rows
