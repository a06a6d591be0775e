"""A decode step's attention kernels on CuPy at Flash's shapes, one launch each at several context lengths.

For a ratio-4 layer at context C (C / 4 compressed rows, the raw ring of ``Geometry.for_context``): the indexer's
scores (64 heads of 128 dims), its top-512 (``indexer_allowed``) on distinct scores and on scores with many ties,
on the threads the launcher gives a decode step and on ROW_GROUP threads (each key names its thread count), and the
split-key attention over the raw ring and the compressed rows (64 heads of 512 dims, the window and 512 rows
visible). Each kernel's time is a launch's share of a CUDA graph of LAUNCHES of them back to back (qmatmul_bench's
``graph_seconds``): launched one by one from Python the host's launches, not the kernels, set the time (on
2026-12-06 the same launch timed 25-70 us from one run to the next). In a graph each launch starts as the one
before it ends (programmatic launches: it waits for those writes), as in a decode step's chain; the rows it reads
stay in the L2 cache from one launch to the next, where a decode step reads them from memory.

    python benchmarks/decode_attention_bench.py [--contexts 4096 32768] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from cupy_required import check
from qmatmul_bench import graph_seconds

from ds4lab.config import FLASH
from ds4lab.kv.layout import Geometry

try:  # without CuPy, --help still reads; main says what is missing
    import cupy as cp

    from ds4lab.cuda import CudaKernels
    missing = None
except ImportError as e:
    missing = e
from ds4lab.mlx_kernels import specs as S

LAUNCHES = 20  # a kernel's launches in its graph


def timed_us(call) -> float:
    """GPU microseconds of one of LAUNCHES calls of ``call`` replayed back to back as one CUDA graph (its best of
    three runs of 20 replays)."""
    return graph_seconds([call] * LAUNCHES, 20) / LAUNCHES * 1e6


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="*", default=[4096, 32768])
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    check(missing)
    kernels = CudaKernels("float32")
    wide = kernels.wide_group
    rng = np.random.default_rng(0)
    cfg, rows = FLASH, []
    for ctx in args.contexts:
        N, raw_cap = ctx // 4, Geometry.for_context(cfg, ctx).raw_cap
        r = {"context": ctx, "compressed_rows": N, "raw_rows": raw_cap}
        q = cp.asarray(rng.standard_normal((1, cfg.idx_heads, cfg.idx_dim), dtype=np.float32))
        w = cp.asarray(rng.standard_normal((1, cfg.idx_heads), dtype=np.float32))
        k = cp.asarray(rng.standard_normal((N, cfg.idx_dim), dtype=np.float32))
        r["indexer_scores_us"] = timed_us(lambda: kernels.indexer_scores(q, w, k))
        visible = cp.ones((1, N), dtype=cp.bool_)
        n_vis = cp.asarray(np.array([N], np.int32))
        distinct = cp.asarray(rng.standard_normal((1, N), dtype=np.float32))
        tied = cp.round(distinct * 2) / 2
        for group in (wide, S.ROW_GROUP):  # the launcher's choice, and ROW_GROUP threads
            kernels.wide_group = group
            threads = S.indexer_allowed_threads(1, N, group)
            for name, score in (("distinct", distinct), ("tied", tied)):
                r[f"indexer_allowed_{name}_{threads}_us"] = timed_us(
                    lambda s=score: kernels.indexer_allowed(s, visible, n_vis, cfg.idx_topk))
        kernels.wide_group = wide
        D = cfg.head_dim
        qa = cp.asarray(rng.standard_normal((1, cfg.n_head, D), dtype=np.float32))
        raw = cp.asarray(rng.standard_normal((raw_cap, D), dtype=np.float32))
        comp = cp.asarray(rng.standard_normal((N, D), dtype=np.float32))
        sinks = cp.asarray(rng.standard_normal(cfg.n_head, dtype=np.float32))
        raw_vis = cp.zeros((1, raw_cap), dtype=cp.bool_)
        raw_vis[0, : cfg.swa] = True
        comp_vis = cp.zeros((1, N), dtype=cp.bool_)
        comp_vis[0, rng.permutation(N)[: min(N, cfg.idx_topk)]] = True
        r["attend_us"] = timed_us(lambda: kernels.attend(qa, raw, raw_vis, sinks, D ** -0.5, (comp, comp_vis)))
        rows.append(r)
        print(", ".join(f"{k}: {v:.1f}" if isinstance(v, float) else f"{k}: {v}" for k, v in r.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
