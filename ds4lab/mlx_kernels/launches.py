"""Kernel launches written once over an array library: the host side shared by the CuPy launcher
(:mod:`ds4lab.cuda`) and the CPU emulator (:mod:`.cpu`). A subclass sets ``xp`` and ``_run``."""

from __future__ import annotations

import numpy as np

from ..quants import iq2xxs_tables
from . import specs as S


class KernelLaunches:
    """Each method allocates its outputs, plans the grid and launches one kernel of :mod:`.specs`.
    Launch constants (dims, dense qmatmul plans) are made once and kept."""

    xp = None

    def __init__(self):
        self.aux = self.xp.asarray(iq2xxs_tables())
        self._consts: dict[tuple, object] = {}

    def _run(self, spec, grid: tuple[int, int], threads: int, args: tuple) -> None:
        raise NotImplementedError

    def _const(self, *values, dtype=np.int32):
        key = (dtype, values)
        if key not in self._consts:
            self._consts[key] = self.xp.asarray(np.array(values, dtype=dtype))
        return self._consts[key]

    def _f32(self, x):
        return self.xp.ascontiguousarray(x, dtype=self.xp.float32)

    def dequant(self, w, qtype, ne0: int, rows: int):
        """Rows of GGUF blocks ``w [rows, row_bytes]`` → float32 ``[rows, ne0]``."""
        out = self.xp.empty((rows, ne0), dtype=self.xp.float32)
        dims = self._const(rows, ne0, S.row_bytes(qtype, ne0))
        self._run(S.dequant_spec(qtype), (-(-ne0 // S.DEQUANT_GROUP), rows), S.DEQUANT_GROUP, (w, self.aux, dims, out))
        return out

    def _dense_plan(self, n_pairs: int):
        key = ("plan", n_pairs)
        if key not in self._consts:
            order, batches = S.pair_batches(None, n_pairs)
            self._consts[key] = (self.xp.asarray(order), self.xp.asarray(batches), len(batches))
        return self._consts[key]

    def qmatmul(self, x, w, qtype, ne0: int, n_rows: int, experts: np.ndarray | None = None):
        """``out[p] = x[p] @ W_{experts[p]}ᵀ`` from the blocks (``experts`` None: one dense matrix)."""
        P = x.shape[0]
        if experts is None:
            order, batches, n_batches = self._dense_plan(P)
        else:
            order, batches = S.pair_batches(experts, P)
            order, batches, n_batches = self.xp.asarray(order), self.xp.asarray(batches), len(batches)
        dims = self._const(ne0, n_rows, S.row_bytes(qtype, ne0), n_batches)
        out = self.xp.empty((P, n_rows), dtype=self.xp.float32)
        self._run(S.qmatmul_spec(qtype), (-(-n_rows // S.QMATMUL_ROWS_PER_GROUP), n_batches),
                  32 * S.QMATMUL_ROWS_PER_GROUP, (self._f32(x), w, self.aux, order, batches, dims, out))
        return out

    def attention(self, q, keys, visible, sinks, scale: float):
        """Softmax attention with sinks over visible keys (spec §3.8) in two passes: splits, then merge."""
        xp = self.xp
        T, H, D = q.shape
        N = keys.shape[0]
        dims_host = S.attn_dims(T, H, D, N)
        dims, splits = self._const(*dims_host.tolist()), int(dims_host[4])
        part_m = xp.empty((T * H, splits), dtype=xp.float32)
        part_l = xp.empty((T * H, splits), dtype=xp.float32)
        part_acc = xp.empty((T * H, splits, D), dtype=xp.float32)
        vis = xp.ascontiguousarray(visible).view(xp.uint8) if visible.dtype == xp.bool_ else visible.astype(xp.uint8)
        self._run(S.ATTN_PARTIAL, (T * H, splits), S.ATTN_GROUP,
                  (self._f32(q * scale), self._f32(keys), xp.ascontiguousarray(vis), dims, part_m, part_l, part_acc))
        out = xp.empty((T, H, D), dtype=xp.float32)
        self._run(S.ATTN_REDUCE, (T * H, 1), S.ATTN_GROUP, (part_m, part_l, part_acc, self._f32(sinks), dims, out))
        return out

    def hc_mix(self, mix, scale, base, X, iters: int, eps: float):
        """(x_in [T, E], post [T, n], comb [T, n, n]) from the mixer's linear output (spec §3.1)."""
        xp = self.xp
        T, n, E = X.shape
        if n > S.HC_MAX:
            raise ValueError(f"hc_mix kernel: {n} hyper-connection streams exceed {S.HC_MAX}")
        x_in = xp.empty((T, E), dtype=xp.float32)
        post = xp.empty((T, n), dtype=xp.float32)
        comb = xp.empty((T, n, n), dtype=xp.float32)
        self._run(S.HC_MIX, (T, 1), 128, (self._f32(mix), self._f32(scale), self._f32(base), self._f32(X),
                                          self._const(T, n, E, iters), self._const(eps, dtype=np.float32),
                                          x_in, post, comb))
        return x_in, post, comb

    def rmsnorm(self, x, eps: float, weight=None):
        D = x.shape[-1]
        x2 = self._f32(x).reshape(-1, D)
        y = self.xp.empty_like(x2)
        w = self._f32(weight) if weight is not None else x2
        self._run(S.RMSNORM, (x2.shape[0], 1), S.ROW_GROUP,
                  (x2, w, self._const(x2.shape[0], D, int(weight is not None)), self._const(eps, dtype=np.float32), y))
        return y.reshape(x.shape)

    def kv_store(self, x, n_rot: int):
        D = x.shape[-1]
        x2 = self._f32(x).reshape(-1, D)
        y = self.xp.empty_like(x2)
        self._run(S.KV_STORE, (x2.shape[0], 1), 32, (x2, self._const(x2.shape[0], D, n_rot), y))
        return y.reshape(x.shape)

    def hadamard_fp4(self, x):
        n = x.shape[-1]
        x2 = self._f32(x).reshape(-1, n)
        y = self.xp.empty_like(x2)
        self._run(S.HADAMARD_FP4, (x2.shape[0], 1), n,
                  (x2, self._const(x2.shape[0], n), self._const(1.0 / n ** 0.5, dtype=np.float32), y))
        return y.reshape(x.shape)

    def compress_pool(self, state_kv, state_sc, kv, sc, start: int, ratio: int):
        """The compressor's pooled rows for a chunk whose first row is timeline row ``start``."""
        (C, W), c = kv.shape, 2 if ratio == 4 else 1
        n_out, width = S.pool_shape(ratio, C, W)
        out = self.xp.empty((n_out, width), dtype=self.xp.float32)
        self._run(S.COMPRESS_POOL, (-(-n_out * width // S.ROW_GROUP), 1), S.ROW_GROUP,
                  (self._f32(state_kv), self._f32(state_sc), self._f32(kv), self._f32(sc), self._const(int(start)),
                   self._const(C, W, ratio, c, n_out), out))
        return out

    def indexer_scores(self, q, w, k):
        """``score [T, N]`` of every compressed indexer row ``k [N, Dq]`` for queries ``q [T, H, Dq]``."""
        T, H, Dq = q.shape
        N = k.shape[0]
        out = self.xp.empty((T, N), dtype=self.xp.float32)
        self._run(S.INDEXER_SCORES, (-(-T * N // S.ROW_GROUP), 1), S.ROW_GROUP,
                  (self._f32(q), self._f32(w), self._f32(k), self._const(T, H, Dq, N), out))
        return out

    def indexer_topk(self, score, visible, n_visible, top_k: int):
        """Boolean ``[T, N]``: each query's top-k visible rows when more than k are visible, else all visible."""
        xp = self.xp
        T, N = score.shape
        allowed = xp.empty((T, N), dtype=xp.uint8)
        vis = xp.ascontiguousarray(visible).view(xp.uint8) if visible.dtype == xp.bool_ else visible.astype(xp.uint8)
        self._run(S.INDEXER_TOPK, (T, 1), S.ROW_GROUP,
                  (self._f32(score), xp.ascontiguousarray(vis), xp.ascontiguousarray(n_visible, dtype=xp.int32),
                   self._const(T, N, top_k), allowed))
        return allowed.view(xp.bool_)

    def rope(self, x, cos, sin, inverse: bool = False):
        """RoPE on the last ``2·cos.shape[-1]`` dims of ``x [T, ..., D]``."""
        T, D = x.shape[0], x.shape[-1]
        x3 = self._f32(x).reshape(T, -1, D)
        y = self.xp.empty_like(x3)
        self._run(S.ROPE, (-(-x3.size // S.ROW_GROUP), 1), S.ROW_GROUP,
                  (x3, self._f32(cos), self._f32(sin), self._const(T, x3.shape[1], D, 2 * cos.shape[-1], int(inverse)),
                   y))
        return y.reshape(x.shape)
