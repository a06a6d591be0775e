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


class CudaKernels:
    """Kernel launches on the current CuPy device; small constant arrays are uploaded once and kept."""

    def __init__(self):
        self.device_id = cp.cuda.Device().id
        self.module = _module(self.device_id)
        self.aux = cp.asarray(iq2xxs_tables())
        self._consts: dict[tuple, cp.ndarray] = {}

    def _const(self, values: np.ndarray) -> cp.ndarray:
        key = (values.dtype.str, values.shape, values.tobytes())
        if key not in self._consts:
            self._consts[key] = cp.asarray(values)
        return self._consts[key]

    def dequant(self, w, qtype, ne0: int, rows: int):
        """Rows of GGUF blocks ``w [rows, row_bytes]`` → float32 ``[rows, ne0]``."""
        out = cp.empty((rows, ne0), dtype=cp.float32)
        dims = self._const(np.array([rows, ne0, S.row_bytes(qtype, ne0)], dtype=np.int32))
        grid = (-(-ne0 // S.DEQUANT_GROUP), rows)
        self.module.get_function(S.dequant_spec(qtype).name)(grid, (S.DEQUANT_GROUP,), (w, self.aux, dims, out))
        return out

    def qmatmul(self, x, w, qtype, ne0: int, n_rows: int, experts: np.ndarray | None = None):
        """``out[p] = x[p] @ W_{experts[p]}ᵀ`` from the blocks (``experts`` None: one dense matrix)."""
        P = x.shape[0]
        order, batches = S.pair_batches(experts, P)
        if experts is None:
            order, batches = self._const(order), self._const(batches)
        else:
            order, batches = cp.asarray(order), cp.asarray(batches)
        dims = self._const(np.array([ne0, n_rows, S.row_bytes(qtype, ne0), len(batches)], dtype=np.int32))
        out = cp.empty((P, n_rows), dtype=cp.float32)
        grid = (-(-n_rows // S.QMATMUL_ROWS_PER_GROUP), len(batches))
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        self.module.get_function(S.qmatmul_spec(qtype).name)(
            grid, (32 * S.QMATMUL_ROWS_PER_GROUP,), (x, w, self.aux, order, batches, dims, out))
        return out

    def attention(self, q, keys, visible, sinks, scale: float):
        """Softmax attention with sinks over visible keys (spec §3.8) in two passes: splits, then merge."""
        T, H, D = q.shape
        N = keys.shape[0]
        dims_host = S.attn_dims(T, H, D, N)
        dims, splits = self._const(dims_host), int(dims_host[4])
        part_m = cp.empty((T * H, splits), dtype=cp.float32)
        part_l = cp.empty((T * H, splits), dtype=cp.float32)
        part_acc = cp.empty((T * H, splits, D), dtype=cp.float32)
        qs = cp.ascontiguousarray(q * scale, dtype=cp.float32)
        vis = cp.ascontiguousarray(visible).view(cp.uint8) if visible.dtype == cp.bool_ else visible.astype(cp.uint8)
        keys = cp.ascontiguousarray(keys, dtype=cp.float32)
        self.module.get_function(S.ATTN_PARTIAL.name)(
            (T * H, splits), (S.ATTN_GROUP,), (qs, keys, vis, dims, part_m, part_l, part_acc))
        out = cp.empty((T, H, D), dtype=cp.float32)
        self.module.get_function(S.ATTN_REDUCE.name)(
            (T * H,), (S.ATTN_GROUP,), (part_m, part_l, part_acc, cp.ascontiguousarray(sinks, dtype=cp.float32),
                                        dims, out))
        return out
