"""Launchers for the CuPy backend: the same kernel bodies as MLX's, compiled once per process by NVRTC
(CuPy keeps the compiled module in its on-disk kernel cache, so later processes start warm)."""

from __future__ import annotations

from functools import lru_cache

import cupy as cp
import numpy as np

from ..mlx_kernels import specs as S
from ..mlx_kernels.dialects import cuda_module_source
from ..quants import iq2xxs_tables


@lru_cache(maxsize=None)
def _module(device_id: int):
    with cp.cuda.Device(device_id):
        module = cp.RawModule(code=cuda_module_source(S.all_specs()), options=("--std=c++17",))
        module.compile()
        return module


def _f32(x):
    return cp.ascontiguousarray(x, dtype=cp.float32)


class CudaKernels:
    """Kernel launches on the current CuPy device. Launch constants (dims, dense qmatmul plans) are
    uploaded once and kept, so a launch costs no host-to-device copy."""

    def __init__(self):
        self.device_id = cp.cuda.Device().id
        self.module = _module(self.device_id)
        self.aux = cp.asarray(iq2xxs_tables())
        self._functions: dict[str, object] = {}
        self._consts: dict[tuple, cp.ndarray] = {}

    def _fn(self, spec):
        if spec.name not in self._functions:
            self._functions[spec.name] = self.module.get_function(spec.name)
        return self._functions[spec.name]

    def _const(self, *values, dtype=np.int32) -> cp.ndarray:
        key = (dtype, values)
        if key not in self._consts:
            self._consts[key] = cp.asarray(np.array(values, dtype=dtype))
        return self._consts[key]

    def dequant(self, w, qtype, ne0: int, rows: int):
        """Rows of GGUF blocks ``w [rows, row_bytes]`` → float32 ``[rows, ne0]``."""
        out = cp.empty((rows, ne0), dtype=cp.float32)
        dims = self._const(rows, ne0, S.row_bytes(qtype, ne0))
        grid = (-(-ne0 // S.DEQUANT_GROUP), rows)
        self._fn(S.dequant_spec(qtype))(grid, (S.DEQUANT_GROUP,), (w, self.aux, dims, out))
        return out

    def _dense_plan(self, n_pairs: int):
        key = ("plan", n_pairs)
        if key not in self._consts:
            order, batches = S.pair_batches(None, n_pairs)
            self._consts[key] = (cp.asarray(order), cp.asarray(batches), len(batches))
        return self._consts[key]

    def qmatmul(self, x, w, qtype, ne0: int, n_rows: int, experts: np.ndarray | None = None):
        """``out[p] = x[p] @ W_{experts[p]}ᵀ`` from the blocks (``experts`` None: one dense matrix)."""
        P = x.shape[0]
        if experts is None:
            order, batches, n_batches = self._dense_plan(P)
        else:
            order, batches = S.pair_batches(experts, P)
            order, batches, n_batches = cp.asarray(order), cp.asarray(batches), len(batches)
        dims = self._const(ne0, n_rows, S.row_bytes(qtype, ne0), n_batches)
        out = cp.empty((P, n_rows), dtype=cp.float32)
        grid = (-(-n_rows // S.QMATMUL_ROWS_PER_GROUP), n_batches)
        self._fn(S.qmatmul_spec(qtype))(grid, (32 * S.QMATMUL_ROWS_PER_GROUP,),
                                        (_f32(x), w, self.aux, order, batches, dims, out))
        return out

    def attention(self, q, keys, visible, sinks, scale: float):
        """Softmax attention with sinks over visible keys (spec §3.8) in two passes: splits, then merge."""
        T, H, D = q.shape
        N = keys.shape[0]
        dims_host = S.attn_dims(T, H, D, N)
        dims, splits = self._const(*dims_host.tolist()), int(dims_host[4])
        part_m = cp.empty((T * H, splits), dtype=cp.float32)
        part_l = cp.empty((T * H, splits), dtype=cp.float32)
        part_acc = cp.empty((T * H, splits, D), dtype=cp.float32)
        vis = cp.ascontiguousarray(visible).view(cp.uint8) if visible.dtype == cp.bool_ else visible.astype(cp.uint8)
        self._fn(S.ATTN_PARTIAL)((T * H, splits), (S.ATTN_GROUP,),
                                 (_f32(q * scale), _f32(keys), vis, dims, part_m, part_l, part_acc))
        out = cp.empty((T, H, D), dtype=cp.float32)
        self._fn(S.ATTN_REDUCE)((T * H,), (S.ATTN_GROUP,), (part_m, part_l, part_acc, _f32(sinks), dims, out))
        return out

    def hc_mix(self, mix, scale, base, X, iters: int, eps: float):
        """(x_in [T, E], post [T, n], comb [T, n, n]) from the mixer's linear output (spec §3.1)."""
        T, n, E = X.shape
        if n > S.HC_MAX:
            raise ValueError(f"hc_mix kernel: {n} hyper-connection streams exceed {S.HC_MAX}")
        x_in = cp.empty((T, E), dtype=cp.float32)
        post = cp.empty((T, n), dtype=cp.float32)
        comb = cp.empty((T, n, n), dtype=cp.float32)
        self._fn(S.HC_MIX)((T,), (128,), (_f32(mix), _f32(scale), _f32(base), _f32(X), self._const(T, n, E, iters),
                                          self._const(eps, dtype=np.float32), x_in, post, comb))
        return x_in, post, comb

    def rmsnorm(self, x, eps: float, weight=None):
        D = x.shape[-1]
        x2 = _f32(x).reshape(-1, D)
        y = cp.empty_like(x2)
        w = _f32(weight) if weight is not None else x2
        self._fn(S.RMSNORM)((x2.shape[0],), (S.ROW_GROUP,),
                            (x2, w, self._const(x2.shape[0], D, int(weight is not None)),
                             self._const(eps, dtype=np.float32), y))
        return y.reshape(x.shape)

    def kv_store(self, x, n_rot: int):
        D = x.shape[-1]
        x2 = _f32(x).reshape(-1, D)
        y = cp.empty_like(x2)
        self._fn(S.KV_STORE)((x2.shape[0],), (32,), (x2, self._const(x2.shape[0], D, n_rot), y))
        return y.reshape(x.shape)

    def hadamard_fp4(self, x):
        n = x.shape[-1]
        x2 = _f32(x).reshape(-1, n)
        y = cp.empty_like(x2)
        self._fn(S.HADAMARD_FP4)((x2.shape[0],), (n,), (x2, self._const(x2.shape[0], n),
                                                        self._const(1.0 / n ** 0.5, dtype=np.float32), y))
        return y.reshape(x.shape)
