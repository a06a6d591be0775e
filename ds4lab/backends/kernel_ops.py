"""What the backends share around ds4lab's kernels: :class:`KernelOps`, the ops a backend runs through a
kernel when it has one and through the plain array ops otherwise, and linears that keep a GGUF weight
in its block form on the GPU.

A few rows (a decode step) go through ``qmatmul`` (F32 weights too, so a decode step calls no BLAS and
can be captured as a CUDA graph), which decodes each weight row once per batch of up to
eight rows of x. A chunk's routed experts go through ``qgemm``: every (token, expert) pair of a projection
in one tiled launch that decodes the blocks into shared memory, with no dequantized copy of any weight. A
chunk through a dense linear dequantizes the matrix into a transient float32 buffer and uses the library's
GEMM, unless ``BlockLinear.qgemm_chunks`` sends it through ``qgemm`` too. Nothing dequantized is kept (but a
token embedding of a type no kernel decodes, decoded once where a compiled step looks rows up on the device).

Attention likewise: a few queries go through the split-key kernel (blocks of heads sharing each key read);
a chunk through ``attn_chunk``, which never makes the scores (an online softmax over tiles of each query's
visible keys), or, with ``ATTN_CHUNK_KERNEL`` off, through the plain ops (GEMMs around a [T, H, N] score
tensor).
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q

from ..mlx_kernels.specs import DECODERS, HC_MAX, INDEXER_MAX_DQ, QGEMM_BM, ROUTE_MAX_EXPERTS, ROUTE_MAX_K
from ..model import compressor as cz
from ..model import numerics as nx
from ..model.attention import attend_with_sinks, compressed_visible, indexer_allowed, indexer_scores, ring_write
from ..model.functional import rmsnorm
from ..model.hc import hc_post, hc_pre
from ..model.moe import route_weights, router_probs, select_topk_on_device, swiglu
from ..model.rope import rope_tail
from ..quants import dequantize

KERNEL_MAX_ROWS = 16  # up to this many rows of x (or pairs), qmatmul; beyond, qgemm or dequantize + GEMM
ATTN_KERNEL_MAX_QUERIES = 16  # decode-sized query blocks use the split-key kernel; chunks see ATTN_CHUNK_KERNEL
# True: chunks attend through attn_chunk, which makes no [T, H, N] score tensor and does work only for
# the keys each query sees (a 128-key window, the indexer's top-k rows); False: through the plain ops'
# float32 GEMMs over every key. On the Flash slice attn_chunk makes prefill faster and its memory pool
# smaller (benchmarks/gpu_slice.py, and --no-attn-chunk for the GEMMs; figures in benchmarks/README.md);
# the GEMMs win only where most keys are visible (attn_chunk_bench.py).
ATTN_CHUNK_KERNEL = True
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
            out = self.kernels.dense_product(x2, self.raw.view(np.float32).reshape(self.n_rows, self.ne0))
        else:
            out = self.kernels.dense_product(x2, self.kernels.dequant(self.raw, self.qtype, self.ne0, self.n_rows))
        return out.reshape(tuple(lead) + (self.n_rows,))


class StackedBlockLinear:
    """All experts of one routed-expert tensor ``raw [n_expert, rows, row_bytes]`` on the device.

    ``stacked(x, experts, repeat)`` gives row p // repeat of ``x`` times expert ``experts[p]``ᵀ for every pair
    p in one launch: qmatmul for a few pairs (on x's rows repeated), qgemm for a chunk's (which reads each row
    of x for its ``repeat`` pairs: a token's k experts)."""

    def __init__(self, kernels, raw, qtype: Q, ne0: int, n_rows: int):
        self.kernels, self.raw, self.qtype, self.ne0, self.n_rows = kernels, raw, Q(qtype), ne0, n_rows

    def __call__(self, x, experts, repeat: int = 1):
        """``experts``: host ids, or a device array of them (the routing of a step of up to DEVICE_ROUTING_ROWS
        tokens, which never leaves the device: qmatmul plans it there, however many pairs it makes)."""
        if x.shape[0] * repeat > KERNEL_MAX_ROWS and self.kernels.on_host(experts):
            return self.kernels.qgemm(x, self.raw, self.qtype, self.ne0, self.n_rows, experts, repeat)
        x = x if repeat == 1 else self.kernels.xp.repeat(x, repeat, axis=0)
        return self.kernels.qmatmul(x, self.raw, self.qtype, self.ne0, self.n_rows, experts)

    def grouped(self, x):
        """``x [T, n, ne0]``: row t of group g times matrix g, as ``[T, n · rows]`` in group order (a chunk's
        attn_output_a: every matrix dequantized, then one batched GEMM)."""
        return self.kernels.grouped_product(x, self.raw, self.qtype, self.ne0, self.n_rows)


class BlockEmbedding:
    """``tokens -> rows`` of the token embedding for a block backend: a chunk's rows gathered from the table's
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
        return self.on_device(self.backend.xp.asarray(np.asarray(tokens, dtype=np.int32)))

    def on_device(self, ids):
        """Rows of device int32 ``ids``."""
        blocks = self.qtype in KERNEL_TYPES
        if self.table is None:
            self.table = (self.backend._blocks(self.raw) if blocks
                          else self.backend.asarray(dequantize(self.raw, self.qtype, self.ne0)))
        rows = self.table[ids]
        return self.kernels.dequant(rows, self.qtype, self.ne0, ids.shape[0]) if blocks else rows


class KernelOps:
    """Model ops with a kernel behind them where ``self.kernels`` has one; the plain ops of ``self.xp``
    (the reference the kernels are tested against) everywhere else."""

    kernels = None

    def device_key(self):
        """Which device arrays made now land on (None: the backend has one memory)."""
        return None

    def _blocks(self, raw):
        """GGUF bytes as a device array for the kernels."""
        return self.xp.asarray(raw)

    def embedding(self, raw, qtype, ne0: int):
        """``tokens -> rows`` of the token embedding ``raw [vocab, row_bytes]``: decoded on the host, uploaded."""
        return lambda tokens: self.asarray(dequantize(raw[tokens], qtype, ne0))

    def stacked_linear(self, raw, qtype, ne0: int) -> StackedBlockLinear | None:
        """Every matrix of ``raw [n, rows, row_bytes]`` (the experts of a routed-expert tensor, the groups of
        attn_output_a) in block form on the device, multiplied in one launch; None without a kernel for it."""
        if self.kernels is None or Q(qtype) not in KERNEL_TYPES:
            return None
        return StackedBlockLinear(self.kernels, self._blocks(raw), qtype, ne0, raw.shape[1])

    def upload(self, arrays: list[np.ndarray]) -> list:
        """Host arrays as backend arrays: floats as :meth:`asarray` makes them, integers as int32."""
        return [self.asarray(a) if a.dtype.kind == "f" else self.xp.array(np.asarray(a, dtype=np.int32))
                for a in arrays]

    def attend(self, q, keys, visible, sinks, scale: float):
        """Attention with sinks: the split-key kernel for a few queries (it spreads their keys over many
        groups, each a block of heads sharing its key reads); for a chunk, the chunk kernel (a group per query
        and block of heads) if ATTN_CHUNK_KERNEL, else the plain ops."""
        if self.kernels is not None and q.shape[0] <= ATTN_KERNEL_MAX_QUERIES:
            return self.kernels.attention(q, keys, visible, sinks, scale)
        if self.kernels is not None and ATTN_CHUNK_KERNEL:
            return self.kernels.attention_chunk(q, keys, visible, sinks, scale)
        return attend_with_sinks(self.xp, q, keys, visible, sinks, scale)

    def hc_pre(self, X, fn, scale, base, iters: int, eps: float, norm_eps: float):
        """(x_in, post, comb) of the mixer before a sublayer (:func:`ds4lab.model.hc.hc_pre`). The kernel takes
        ``fn`` of the flat state rather than of its RMS normalisation and divides by the RMS itself (``fn`` is
        linear), so no normalised copy is made: one launch fewer a sublayer."""
        T, n, E = X.shape
        if self.kernels is not None and n <= HC_MAX:
            return self.kernels.hc_mix(fn(X.reshape(T, n * E)), scale, base, X, iters, eps, norm_eps)
        return hc_pre(self, X, fn, scale, base, iters=iters, eps=eps, norm_eps=norm_eps)

    def hc_post(self, y, X, post, comb):
        if self.kernels is not None:
            return self.kernels.hc_post(y, X, post, comb)
        return hc_post(self.xp, y, X, post, comb)

    def rope(self, x, cos, sin, inverse: bool = False):
        """RoPE on the tail dims (see :func:`ds4lab.model.rope.rope_tail`)."""
        if self.kernels is not None:
            return self.kernels.rope(x, cos, sin, inverse)
        return rope_tail(self.xp, x, cos, sin, inverse)

    def rmsnorm(self, x, eps: float, weight=None):
        if self.kernels is not None:
            return self.kernels.rmsnorm(x, eps, weight)
        return rmsnorm(self.xp, x, eps, weight)

    def rmsnorm_rope(self, x, eps: float, weight, cos, sin):
        """``(rmsnorm(x), its rows with RoPE on the tail)``: one launch with kernels (rmsnorm then rope take two)."""
        if self.kernels is not None:
            return self.kernels.rmsnorm_rope(x, eps, weight, cos, sin)
        y = rmsnorm(self.xp, x, eps, weight)
        return y, rope_tail(self.xp, y, cos, sin)

    def store_kv(self, x, n_rot: int):
        """FP8 on the non-RoPE dims, then F16 rounding, as every cached attention row is stored
        (docs/MODEL.md, "Numerics")."""
        if self.kernels is not None and (x.shape[-1] - n_rot) % nx.FP8_BLOCK == 0:
            return self.kernels.kv_store(x, n_rot)
        return nx.f16_round(self.xp, nx.fp8_kv_sim(self.xp, x, n_rot))

    def compress_chunk(self, state_kv, state_sc, kv, sc, pos0, n_valid, ratio: int):
        """``(pooled, new_kv, new_sc)`` of :func:`ds4lab.model.compressor.compress_chunk`: a kernel pools, another
        makes the new state."""
        if self.kernels is None:
            return cz.compress_chunk(self.xp, state_kv, state_sc, kv, sc, pos0, n_valid, ratio)
        pooled = self.kernels.compress_pool(state_kv, state_sc, kv, sc, pos0, ratio)
        return (pooled, *self.kernels.compress_state(state_kv, state_sc, kv, sc, pos0, n_valid, ratio))

    def add_ape(self, gate, ape, pos0):
        """The compressor's scores (:func:`ds4lab.model.compressor.add_ape`)."""
        if self.kernels is None:
            return cz.add_ape(self.xp, gate, ape, pos0)
        return self.kernels.ape_add(gate, ape, pos0)

    def append_rows(self, rows, pooled, pos0, n_valid, ratio: int):
        """The compressed rows after a chunk (:func:`ds4lab.model.compressor.append_rows`)."""
        if self.kernels is None:
            return cz.append_rows(self.xp, rows, pooled, pos0, n_valid, ratio)
        return self.kernels.append_rows(rows, pooled, pos0, n_valid, ratio)

    def compressed_visible(self, pos0, n_valid, C: int, n_rows: int, ratio: int):
        """``(n_vis, visible)`` of :func:`ds4lab.model.attention.compressed_visible`: one launch with kernels."""
        if self.kernels is None:
            return compressed_visible(self.xp, pos0, n_valid, C, n_rows, ratio)
        return self.kernels.compressed_visible(pos0, n_valid, C, n_rows, ratio)

    def ring_write(self, raw, kv, pos0, n_valid, window: int):
        """``(raw, slot_pos, visible)``: the raw ring after a chunk (:func:`ds4lab.model.attention.ring_write`)."""
        if self.kernels is None:
            return ring_write(self.xp, raw, kv, pos0, n_valid, window)
        return self.kernels.ring_write(raw, kv, pos0, n_valid, window)

    def indexer_scores(self, q, w, k):
        """The indexer's scores (docs/MODEL.md, "Attention"): the kernel for a few queries; for a chunk the
        matrix-unit kernel where the heads divide its tiles, else plain ops (a GEMM and a [T, H, N] tensor)."""
        if self.kernels is not None and q.shape[0] <= ATTN_KERNEL_MAX_QUERIES and q.shape[2] <= INDEXER_MAX_DQ:
            return self.kernels.indexer_scores(q, w, k)
        if self.kernels is not None and QGEMM_BM % q.shape[1] == 0:
            return self.kernels.indexer_chunk(q, w, k)
        return indexer_scores(self.xp, q, w, k)

    def indexer_allowed(self, score, visible, n_visible, top_k: int):
        """Rows each query may attend (see :func:`ds4lab.model.attention.indexer_allowed`): one kernel
        work-group per query where the backend has kernels."""
        if self.kernels is not None:
            return self.kernels.indexer_topk(score, visible, n_visible, top_k)
        return indexer_allowed(self.xp, score, visible, n_visible, top_k)

    def swiglu(self, gate, up, clamp: float, weights=None):
        """:func:`ds4lab.model.moe.swiglu` of ``[P, F]`` rows, times ``weights [P]`` (a pair's route weight) per
        row when given."""
        if self.kernels is not None:
            return self.kernels.swiglu(gate, up, clamp, weights)
        mid = swiglu(self.xp, gate, up, clamp)
        return mid if weights is None else mid * weights[:, None]

    def pair_sum(self, y, k: int):
        """``y [T·k, D]`` (a token's k routed-expert outputs in consecutive rows) summed per token: ``[T, D]``."""
        if self.kernels is not None:
            return self.kernels.pair_sum(y, k)
        return y.reshape(-1, k, y.shape[-1]).sum(axis=1)

    def moe_route(self, logits, bias, k: int, scale: float, table=None, tokens=None):
        """A few tokens' routing without leaving the device (docs/MODEL.md, "Mixture of experts"):
        ``(probs, selected, weights)`` from the router's ``logits [T, n_expert]``. Experts are the top k of
        probs + ``bias`` (None: no bias) in :func:`ds4lab.model.moe.select_topk`'s order or, given the hash
        ``table`` (a device array), its rows of ``tokens`` (host or device ids)."""
        xp = self.xp
        if table is not None and isinstance(tokens, np.ndarray):  # host ids: an eager step
            tokens = xp.array(tokens.astype(np.int32))
        if self.kernels is not None and logits.shape[-1] <= ROUTE_MAX_EXPERTS and k <= ROUTE_MAX_K:
            return self.kernels.moe_route(logits, bias, k, scale, table, tokens)
        probs = router_probs(xp, logits)
        if table is not None:
            selected = table[tokens]
        else:
            selected = select_topk_on_device(xp, probs if bias is None else probs + bias, k)
        return probs, selected, route_weights(xp, probs, selected, scale)

    def hadamard_fp4(self, x, f16: bool = False):
        """The indexer's Hadamard + FP4 step (docs/MODEL.md, "Numerics"); with ``f16`` also the F16 rounding
        of a stored row."""
        n = x.shape[-1]
        if self.kernels is not None and n % 32 == 0 and n <= 1024 and n & (n - 1) == 0:
            return self.kernels.hadamard_fp4(x, f16)
        y = nx.hadamard_fp4_sim(self.xp, x)
        return nx.f16_round(self.xp, y) if f16 else y


class BlockBackend(KernelOps):
    """A float32 backend over an array library ``xp`` whose ``kernels`` run GGUF weights in block form:
    the CuPy backend, and the CPU emulator's backend the tests run the kernels' wiring with. Without
    kernels (``kernels`` None) every weight is dequantized to float32 and every op is plain."""

    np_dtype = np.float32
    can_compile = False

    def asarray(self, a):
        return self.xp.asarray(np.asarray(a, dtype=np.float32))

    def to_numpy(self, x):
        return np.asarray(x)

    def linear(self, raw, qtype, ne0: int):
        qtype, xp = Q(qtype), self.xp
        if self.kernels is None or qtype not in KERNEL_TYPES:
            weight_t = xp.asarray(dequantize(raw, qtype, ne0)).T
            return lambda x: x @ weight_t
        return BlockLinear(self.kernels, self._blocks(raw), qtype, ne0, raw.shape[0])

    def embedding(self, raw, qtype, ne0: int):
        host = super().embedding(raw, qtype, ne0)
        return host if self.kernels is None else BlockEmbedding(self, raw, qtype, ne0, host)

    def index_add(self, acc, rows, values):
        acc[self.xp.asarray(rows)] += values  # rows are distinct
        return acc

    def eval(self, *xs):
        pass
