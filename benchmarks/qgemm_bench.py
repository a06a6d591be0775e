"""qgemm against the per-expert dequantize + GEMM loop it replaces, on a Flash-shaped MoE chunk.

The routed experts of one layer for a 2048-token chunk: 256 experts, 6 per token with seeded random
routing, gate and up IQ2_XXS 4096 → 2048, down Q2_K 2048 → 4096 (seeded random valid blocks; a few
distinct experts repeated to 256, the same bytes to read). For each projection, the time of one qgemm
launch over every (token, expert) pair and of the old path (each expert's rows times its matrix,
dequantized into a transient float32 buffer, through the library's GEMM), after warm-up and with device
synchronisation; then a dense chunk linear (2048 × 4096 x, Q8_0 4096 → 4096): qgemm against dequantize +
GEMM (cuBLAS on CuPy).

    python benchmarks/qgemm_bench.py                       # CuPy on the current GPU
    python benchmarks/qgemm_bench.py --backend mlx         # MLX's GPU back-end
    python benchmarks/qgemm_bench.py --backend emulated --config tiny   # the CPU emulator, tiny shapes
    python benchmarks/qgemm_bench.py --tiles 64x64x32:2x2 64x128x32:2x4   # qgemm alone, other tile shapes
    python benchmarks/qgemm_bench.py --tf32                # prefill_matmul="tf32": both paths on TF32 operands
    python benchmarks/qgemm_bench.py --operands f16        # prefill_matmul="f16": both paths on half operands

``--tiles`` times qgemm alone under other tile shapes, BMxBNxBK:WARPS_MxWARPS_N (CuPy: the kernels are
recompiled for each).

(The emulator's times say nothing about a GPU's: it shows that the script runs.)
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time

import numpy as np
from gguf import GGMLQuantizationType as Q

from ds4lab.mlx_kernels import layout
from ds4lab.mlx_kernels import specs as S
from ds4lab.quants import random_blocks

# (experts, tokens, experts per token, n_embd, expert width, dense rows of x, distinct experts drawn)
CONFIGS = {"flash": (256, 2048, 6, 4096, 2048, 2048, 8), "tiny": (8, 24, 2, 256, 256, 40, 2)}


def launcher(name: str):
    """``(kernels, xp, to_device, sync)`` for a backend; ``sync(x)`` waits until ``x`` is computed."""
    if name == "cupy":
        import cupy as cp

        from ds4lab.cuda import CudaKernels

        return CudaKernels(), cp, cp.asarray, lambda x: cp.cuda.get_current_stream().synchronize()
    if name == "mlx":
        import mlx.core as mx

        from ds4lab.backends.mlx_backend import float32_gemms
        from ds4lab.mlx_kernels.fast import MLXKernels

        def sync(x):
            mx.eval(x)
            mx.synchronize()

        float32_gemms()  # the dense products' GEMMs at float32 precision, as the backend keeps them
        mx.set_default_device(mx.gpu)
        return MLXKernels(), mx, mx.array, sync
    from ds4lab.mlx_kernels.cpu import CpuKernels

    return CpuKernels(), np, np.asarray, lambda x: None


def timed(fn, sync, repeats: int) -> float:
    """Median seconds of ``fn()`` after two warm-up calls, the device synchronised around each call."""
    for _ in range(2):
        sync(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sync(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def per_expert(kernels, xp, x, raw, qtype, ne0: int, n_rows: int, experts: np.ndarray, to_dev):
    """The old chunk path: each expert's pairs times its matrix, dequantized for the library's GEMM."""
    order = np.argsort(experts, kind="stable")
    bounds = np.flatnonzero(np.r_[True, experts[order][1:] != experts[order][:-1], True])
    parts = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        rows = to_dev(order[s:e].astype(np.int32))
        parts.append(kernels.dense_product(x[rows], kernels.dequant(raw[int(experts[order[s]])], qtype, ne0, n_rows)))
    return xp.concatenate(parts, axis=0)[to_dev(np.argsort(order).astype(np.int32))]


def weights(qtype: Q, n_expert: int, rows: int, ne0: int, distinct: int, rng) -> np.ndarray:
    drawn = random_blocks(qtype, (distinct, rows), ne0, rng, 0.02)
    return np.tile(drawn, (-(-n_expert // distinct), 1, 1))[:n_expert]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="cupy", choices=("cupy", "mlx", "emulated"))
    p.add_argument("--config", default="flash", choices=tuple(CONFIGS),
                   help="tiny: small shapes, to try the script on the CPU emulator")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--operands", default="float32", choices=S.OPERANDS,
                   help="prefill_matmul's operands: qgemm's _tf32 / _f16 kernels, and cuBLAS on them for dequant+GEMM")
    p.add_argument("--tf32", action="store_true", help="the same as --operands tf32")
    p.add_argument("--tiles", nargs="*", metavar="BMxBNxBK:WMxWN", help="time qgemm alone with these tile shapes")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)

    n_expert, T, k, E, F, dense_rows, distinct = CONFIGS[args.config]
    kernels, xp, to_dev, sync = launcher(args.backend)
    kernels.chunk_operands = "tf32" if args.tf32 else args.operands
    rng = np.random.default_rng(0)
    experts = np.argsort(rng.random((T, n_expert)), axis=1)[:, :k].reshape(-1)  # k distinct experts a token
    P = len(experts)
    projections = [("gate", Q.IQ2_XXS, E, F), ("up", Q.IQ2_XXS, E, F), ("down", Q.Q2_K, F, E)]
    if args.tiles:
        return tile_shapes(args, projections, experts, (E, dense_rows, n_expert, distinct), rng)
    out = {"backend": args.backend, "config": args.config, "operands": kernels.chunk_operands, "pairs": P,
           "experts": n_expert, "moe": [], "dense": {}}

    def report(name: str, qgemm_s: float, old_s: float, flops: float, old_label: str) -> dict:
        r = {"name": name, "qgemm_ms": qgemm_s * 1e3, "old_ms": old_s * 1e3, "qgemm_tflops": flops / qgemm_s / 1e12,
             "old_tflops": flops / old_s / 1e12, "speedup": old_s / qgemm_s}
        print(f"{name}: qgemm {r['qgemm_ms']:.3f} ms ({r['qgemm_tflops']:.3g} TFLOP/s), {old_label} "
              f"{r['old_ms']:.3f} ms ({r['old_tflops']:.3g} TFLOP/s): {r['speedup']:.2f}x", flush=True)
        return r

    for name, qtype, ne0, n_rows in projections:
        raw = to_dev(layout.blocks(weights(qtype, n_expert, n_rows, ne0, distinct, rng), qtype))
        x = to_dev(rng.standard_normal((P, ne0), dtype=np.float32))
        new = timed(lambda: kernels.qgemm(x, raw, qtype, ne0, n_rows, experts), sync, args.repeats)
        old = timed(lambda: per_expert(kernels, xp, x, raw, qtype, ne0, n_rows, experts, to_dev), sync,
                    args.repeats)
        out["moe"].append(report(f"{name} {qtype.name} {ne0}->{n_rows} x {P} pairs", new, old,
                                 2.0 * P * ne0 * n_rows, "per-expert dequant+GEMM"))
    total_new, total_old = (sum(r[key] for r in out["moe"]) for key in ("qgemm_ms", "old_ms"))
    out["moe_total"] = {"qgemm_ms": total_new, "old_ms": total_old, "speedup": total_old / total_new}
    print(f"MoE layer ({P} pairs): qgemm {total_new:.3f} ms, per-expert {total_old:.3f} ms: "
          f"{total_old / total_new:.2f}x", flush=True)

    raw = to_dev(layout.blocks(random_blocks(Q.Q8_0, (E,), E, rng, 0.02), Q.Q8_0))
    x = to_dev(rng.standard_normal((dense_rows, E), dtype=np.float32))
    new = timed(lambda: kernels.qgemm(x, raw, Q.Q8_0, E, E), sync, args.repeats)
    old = timed(lambda: kernels.dense_product(x, kernels.dequant(raw, Q.Q8_0, E, E)), sync, args.repeats)
    out["dense"] = report(f"dense Q8_0 {E}->{E} x {dense_rows} rows", new, old, 2.0 * dense_rows * E * E,
                          "dequant+GEMM")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


def tile_shapes(args, projections, experts, sizes, rng):
    E, dense_rows, n_expert, distinct = sizes
    P = len(experts)
    cases = [(f"{name} {q.name}", q, ne0, n_rows, weights(q, n_expert, n_rows, ne0, distinct, rng), P, experts)
             for name, q, ne0, n_rows in projections]
    dense = random_blocks(Q.Q8_0, (E,), E, rng, 0.02)
    cases.append((f"dense Q8_0 x {dense_rows}", Q.Q8_0, E, E, dense, dense_rows, None))
    defaults = S.QGEMM_BM, S.QGEMM_BN, S.QGEMM_BK, S.QGEMM_WARPS_M, S.QGEMM_WARPS_N, S.QGEMM_WARPS_N_WIDE
    runs, results = [], {}
    for shape in args.tiles:
        m = re.fullmatch(r"(\d+)x(\d+)x(\d+):(\d+)x(\d+)", shape)
        if m is None:
            raise SystemExit(f"tile shape {shape!r} is not BMxBNxBK:WARPS_MxWARPS_N")
        S.QGEMM_BM, S.QGEMM_BN, S.QGEMM_BK, S.QGEMM_WARPS_M, S.QGEMM_WARPS_N = map(int, m.groups())
        S.QGEMM_WARPS_N_WIDE = S.QGEMM_WARPS_N  # one shape for every type
        if args.backend == "cupy":
            from ds4lab.cuda import kernels as cuda_kernels

            cuda_kernels._functions.cache_clear()
        elif args.backend == "emulated":
            from ds4lab.mlx_kernels import cpu

            cpu._library.cache_clear()
        else:
            raise SystemExit("--tiles recompiles the kernels: CuPy or the emulator")
        kernels, _, to_dev, sync = launcher(args.backend)
        kernels.chunk_operands = "tf32" if args.tf32 else args.operands
        for label, q, ne0, n_rows, raw, rows, ids in cases:
            raw_d = to_dev(layout.blocks(raw, q))
            x = to_dev(np.random.default_rng(rows).standard_normal((rows, ne0), dtype=np.float32))
            s = timed(lambda: kernels.qgemm(x, raw_d, q, ne0, n_rows, ids), sync, args.repeats)
            got = np.asarray(kernels.qgemm(x, raw_d, q, ne0, n_rows, ids).get() if args.backend == "cupy" else
                             kernels.qgemm(x, raw_d, q, ne0, n_rows, ids))
            first = results.setdefault(label, got)
            tflops = 2.0 * rows * ne0 * n_rows / s / 1e12
            differs = float(np.abs(got - first).max() / np.abs(first).max())
            runs.append({"tiles": shape, "case": label, "ms": s * 1e3, "tflops": tflops, "differs": differs})
            print(f"{shape}: {label}: {s * 1e3:.3f} ms ({tflops:.3g} TFLOP/s), differs from the first shape's "
                  f"by {differs:.1e} of the scale", flush=True)
    S.QGEMM_BM, S.QGEMM_BN, S.QGEMM_BK, S.QGEMM_WARPS_M, S.QGEMM_WARPS_N, S.QGEMM_WARPS_N_WIDE = defaults
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": args.backend, "tiles": runs}, f, indent=1)


if __name__ == "__main__":
    main()
