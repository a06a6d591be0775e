"""Launchers for MLX's GPU back-ends: ``mx.fast.cuda_kernel`` on CUDA, ``mx.fast.metal_kernel`` on Apple
GPUs, both built from the same bodies. MLX's ``grid`` counts threads, not groups."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..quants import iq2xxs_tables
from . import specs as S


def gpu_dialect() -> str | None:
    """"cuda" or "metal" when MLX has that GPU back-end, else None."""
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return None


class MLXKernels:
    def __init__(self, dialect: str | None = None):
        self.dialect = dialect or gpu_dialect()
        if self.dialect is None:
            raise RuntimeError("MLX has no GPU back-end here (neither Metal nor CUDA); custom kernels need one")
        self._kernels: dict[str, object] = {}
        self.aux = mx.array(iq2xxs_tables())

    def _kernel(self, spec):
        if spec.name not in self._kernels:
            header, source = spec.mlx_source(self.dialect)
            make = mx.fast.cuda_kernel if self.dialect == "cuda" else mx.fast.metal_kernel
            self._kernels[spec.name] = make(name=spec.name, input_names=spec.input_names,
                                            output_names=spec.output_names, source=source, header=header)
        return self._kernels[spec.name]

    def dequant(self, w, qtype, ne0: int, rows: int):
        dims = mx.array(np.array([rows, ne0, S.row_bytes(qtype, ne0)], dtype=np.int32))
        groups = -(-ne0 // S.DEQUANT_GROUP)
        return self._kernel(S.dequant_spec(qtype))(
            inputs=[w, self.aux, dims], grid=(groups * S.DEQUANT_GROUP, rows, 1), threadgroup=(S.DEQUANT_GROUP, 1, 1),
            output_shapes=[(rows, ne0)], output_dtypes=[mx.float32])[0]

    def qmatmul(self, x, w, qtype, ne0: int, n_rows: int, experts: np.ndarray | None = None):
        P = x.shape[0]
        order, batches = S.pair_batches(experts, P)
        dims = np.array([ne0, n_rows, S.row_bytes(qtype, ne0), len(batches)], dtype=np.int32)
        groups = -(-n_rows // S.QMATMUL_ROWS_PER_GROUP)
        threads = 32 * S.QMATMUL_ROWS_PER_GROUP
        return self._kernel(S.qmatmul_spec(qtype))(
            inputs=[x.astype(mx.float32), w, self.aux, mx.array(order), mx.array(batches), mx.array(dims)],
            grid=(groups * threads, len(batches), 1), threadgroup=(threads, 1, 1),
            output_shapes=[(P, n_rows)], output_dtypes=[mx.float32])[0]

    def attention(self, q, keys, visible, sinks, scale: float):
        T, H, D = q.shape
        N = keys.shape[0]
        dims = S.attn_dims(T, H, D, N)
        splits = int(dims[4])
        dims = mx.array(dims)
        part_m, part_l, part_acc = self._kernel(S.ATTN_PARTIAL)(
            inputs=[(q * scale).astype(mx.float32), keys.astype(mx.float32), visible.astype(mx.uint8), dims],
            grid=(T * H * S.ATTN_GROUP, splits, 1), threadgroup=(S.ATTN_GROUP, 1, 1),
            output_shapes=[(T * H, splits), (T * H, splits), (T * H, splits, D)],
            output_dtypes=[mx.float32] * 3)
        return self._kernel(S.ATTN_REDUCE)(
            inputs=[part_m, part_l, part_acc, sinks.astype(mx.float32), dims],
            grid=(T * H * S.ATTN_GROUP, 1, 1), threadgroup=(S.ATTN_GROUP, 1, 1),
            output_shapes=[(T, H, D)], output_dtypes=[mx.float32])[0]

    def hc_mix(self, mix, scale, base, X, iters: int, eps: float):
        T, n, E = X.shape
        if n > S.HC_MAX:
            raise ValueError(f"hc_mix kernel: {n} hyper-connection streams exceed {S.HC_MAX}")
        f32 = mx.float32
        return tuple(self._kernel(S.HC_MIX)(
            inputs=[mix.astype(f32), scale.astype(f32), base.astype(f32), X.astype(f32),
                    mx.array(np.array([T, n, E, iters], dtype=np.int32)), mx.array(np.array([eps], dtype=np.float32))],
            grid=(T * 128, 1, 1), threadgroup=(128, 1, 1),
            output_shapes=[(T, E), (T, n), (T, n, n)], output_dtypes=[f32] * 3))

    def rmsnorm(self, x, eps: float, weight=None):
        D = x.shape[-1]
        x2 = x.astype(mx.float32).reshape(-1, D)
        R = x2.shape[0]
        w = weight.astype(mx.float32) if weight is not None else x2
        return self._kernel(S.RMSNORM)(
            inputs=[x2, w, mx.array(np.array([R, D, int(weight is not None)], dtype=np.int32)),
                    mx.array(np.array([eps], dtype=np.float32))],
            grid=(R * S.ROW_GROUP, 1, 1), threadgroup=(S.ROW_GROUP, 1, 1),
            output_shapes=[(R, D)], output_dtypes=[mx.float32])[0].reshape(x.shape)

    def kv_store(self, x, n_rot: int):
        D = x.shape[-1]
        x2 = x.astype(mx.float32).reshape(-1, D)
        R = x2.shape[0]
        return self._kernel(S.KV_STORE)(
            inputs=[x2, mx.array(np.array([R, D, n_rot], dtype=np.int32))],
            grid=(R * 32, 1, 1), threadgroup=(32, 1, 1),
            output_shapes=[(R, D)], output_dtypes=[mx.float32])[0].reshape(x.shape)

    def hadamard_fp4(self, x):
        n = x.shape[-1]
        x2 = x.astype(mx.float32).reshape(-1, n)
        R = x2.shape[0]
        return self._kernel(S.HADAMARD_FP4)(
            inputs=[x2, mx.array(np.array([R, n], dtype=np.int32)),
                    mx.array(np.array([1.0 / n ** 0.5], dtype=np.float32))],
            grid=(R * n, 1, 1), threadgroup=(n, 1, 1),
            output_shapes=[(R, n)], output_dtypes=[mx.float32])[0].reshape(x.shape)

    def compress_pool(self, state_kv, state_sc, kv, sc, start, ratio: int):
        (C, W), c = kv.shape, 2 if ratio == 4 else 1
        n_out, width = S.pool_shape(ratio, C, W)
        start = mx.array([start], dtype=mx.int32) if isinstance(start, int) else start.astype(mx.int32).reshape(1)
        groups = -(-n_out * width // S.ROW_GROUP)
        f32 = mx.float32
        return self._kernel(S.COMPRESS_POOL)(
            inputs=[state_kv.astype(f32), state_sc.astype(f32), kv.astype(f32), sc.astype(f32), start,
                    mx.array(np.array([C, W, ratio, c, n_out], dtype=np.int32))],
            grid=(groups * S.ROW_GROUP, 1, 1), threadgroup=(S.ROW_GROUP, 1, 1),
            output_shapes=[(n_out, width)], output_dtypes=[f32])[0]

    def indexer_scores(self, q, w, k):
        T, H, Dq = q.shape
        N = k.shape[0]
        f32 = mx.float32
        groups = -(-T * N // S.ROW_GROUP)
        return self._kernel(S.INDEXER_SCORES)(
            inputs=[q.astype(f32), w.astype(f32), k.astype(f32), mx.array(np.array([T, H, Dq, N], dtype=np.int32))],
            grid=(groups * S.ROW_GROUP, 1, 1), threadgroup=(S.ROW_GROUP, 1, 1),
            output_shapes=[(T, N)], output_dtypes=[f32])[0]

    def indexer_topk(self, score, visible, n_visible, top_k: int):
        T, N = score.shape
        return self._kernel(S.INDEXER_TOPK)(
            inputs=[score.astype(mx.float32), visible.astype(mx.uint8), n_visible.astype(mx.int32),
                    mx.array(np.array([T, N, top_k], dtype=np.int32))],
            grid=(T * S.ROW_GROUP, 1, 1), threadgroup=(S.ROW_GROUP, 1, 1),
            output_shapes=[(T, N)], output_dtypes=[mx.uint8])[0].astype(mx.bool_)

    def rope(self, x, cos, sin, inverse: bool = False):
        T, D = x.shape[0], x.shape[-1]
        x3 = x.astype(mx.float32).reshape(T, -1, D)
        size = x3.size
        return self._kernel(S.ROPE)(
            inputs=[x3, cos.astype(mx.float32), sin.astype(mx.float32),
                    mx.array(np.array([T, x3.shape[1], D, 2 * cos.shape[-1], int(inverse)], dtype=np.int32))],
            grid=(-(-size // S.ROW_GROUP) * S.ROW_GROUP, 1, 1), threadgroup=(S.ROW_GROUP, 1, 1),
            output_shapes=[x3.shape], output_dtypes=[mx.float32])[0].reshape(x.shape)
