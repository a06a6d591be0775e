"""qmatmul for one decode token on the Flash shapes, against the copy bandwidth measured in the same run.

A decode step reads its weights once; qmatmul's time for one row of x is that read. For each product
(the output head, attention and shared-expert Q8_0, the routed experts' IQ2_XXS and Q2_K for 6 selected
experts, F16 and F32 linears) it prints the GPU time of one launch, the bytes of weight read, and that
rate as a fraction of the device-to-device copy's (read + write) bandwidth. The launches are replayed
as a CUDA graph (no host time), each over other weights (other copies, other experts) until 256 MB are
read, so the 50 MB L2 cache does not serve them. ``--variants`` times other kernel shapes: rows per
SIMD group x steps unrolled, "s" after them for the single-pair loop (the module recompiled for each),
after a colon the SIMD groups under which K is split (``QMATMUL_SIMD_GROUPS``; Q8_0's products take
``QMATMUL_Q8_0_GROUPS`` times that), after another the fewest
elements a split holds (``QMATMUL_MIN_SPLIT``); ROWS sets qmatmul_xq8's rows too, "specs" (the default)
leaves every constant as specs.py has it. ``--decode-matmul float32 q8`` times each variant with x in float32
and quantized to int8 per block (``ds4lab.load(decode_matmul="q8")``).

    python benchmarks/qmatmul_bench.py --variants 4x2s 4x2 1x8 2x4s 8x1s:4096 8x1s:1024:512 --json qmatmul.json
"""

from __future__ import annotations

import argparse
import json
import re

import numpy as np
from gguf import GGMLQuantizationType as Q
from gpu_slice import copy_bandwidth

from ds4lab.backends import get_backend
from ds4lab.mlx_kernels import layout
from ds4lab.mlx_kernels import specs as S
from ds4lab.quants import quantize, random_blocks

# (label, type, experts in the tensor, rows, K, selected experts (0: a dense matrix))
SHAPES = [
    ("output head", Q.Q8_0, 0, 129280, 4096, 0),
    ("attn_q_b", Q.Q8_0, 0, 32768, 1024, 0),
    ("attn_output_b", Q.Q8_0, 0, 4096, 8192, 0),
    ("attn_output_a, 8 groups", Q.Q8_0, 8, 1024, 4096, 8),
    ("attn_q_a", Q.Q8_0, 0, 1024, 4096, 0),
    ("shared expert down", Q.Q8_0, 0, 4096, 2048, 0),
    ("routed gate/up", Q.IQ2_XXS, 256, 2048, 4096, 6),
    ("routed down", Q.Q2_K, 256, 4096, 2048, 6),
    ("compressor kv (F16)", Q.F16, 0, 1024, 4096, 0),
    ("router (F16)", Q.F16, 0, 256, 4096, 0),
    ("HC mixer (F16)", Q.F16, 0, 24, 16384, 0),
    ("HC mixer (F32)", Q.F32, 0, 24, 16384, 0),
]


READ_BYTES = 256 << 20  # read per replay, against the L2 cache


def graph_seconds(calls, repeats: int) -> float:
    """GPU seconds of one replay of ``calls`` (functions of no arguments) captured as one CUDA graph."""
    from ds4lab.cuda.graphs import GraphStep

    step = GraphStep(lambda: tuple(call() for call in calls))
    step()  # eager: compiles, makes the launch constants
    step()  # captures
    return min(step.replay_seconds(repeats) for _ in range(3))[0]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="*",
                   default=["specs"],
                   help="ROWSxUNROLL[s][:GROUPS[:MIN_SPLIT]]: rows per SIMD group (q8's too), steps of 256 elements "
                        "unrolled, the single-pair loop, the SIMD groups under which K is split, the fewest elements "
                        "a split holds; specs (default): as ds4lab/mlx_kernels/specs.py has them")
    p.add_argument("--decode-matmul", nargs="+", default=["float32"], choices=["float32", "q8"],
                   help="each variant with x in float32, and/or quantized to int8 per block (ds4lab.load's option)")
    p.add_argument("--only", nargs="*", help="the products whose label starts with one of these (default: all)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)

    import cupy as cp

    from ds4lab.cuda import kernels as cuda_kernels

    rng = np.random.default_rng(0)
    bw = copy_bandwidth(get_backend("cupy", None, True))  # as gpu_slice.py measures it
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (read + write)", flush=True)
    out = {"copy_bandwidth_Bps": bw, "runs": []}
    tensors = []
    for label, qtype, n_expert, rows, K, used in SHAPES:
        if args.only and not any(label.startswith(o) for o in args.only):
            continue
        per_call = rows * layout.row_bytes(qtype, K) * max(used, 1)
        copies = -(-READ_BYTES // per_call)
        if used:  # one tensor of n_expert experts (8 distinct, repeated), other experts each call
            distinct = random_blocks(qtype, (8, rows), K, rng, 0.02)
            raws = [cp.asarray(layout.blocks(np.tile(distinct, (n_expert // 8, 1, 1)), qtype))] * copies
            ids = [cp.asarray(rng.choice(n_expert, used, replace=False).astype(np.int32)) for _ in range(copies)]
        else:  # copies of one matrix
            one = (random_blocks(qtype, (rows,), K, rng, 0.02) if qtype not in (Q.F16, Q.F32) else
                   quantize(rng.standard_normal((rows, K), dtype=np.float32) * 0.02, qtype))
            raws, ids = [cp.asarray(layout.blocks(one, qtype)) for _ in range(copies)], [None] * copies
        x = cp.asarray(rng.standard_normal((max(used, 1), K), dtype=np.float32))
        tensors.append((label, qtype, rows, K, raws, ids, x, per_call))
    defaults = (S.QMATMUL_SIMD_ROWS, S.QMATMUL_XQ8_SIMD_ROWS, S.QMATMUL_UNROLL, S.QMATMUL_SINGLE_PAIR,
                S.QMATMUL_SIMD_GROUPS, S.QMATMUL_MIN_SPLIT)
    for variant in args.variants:
        m = re.fullmatch(r"(\d+)x(\d+)(s?)(?::(\d+)(?::(\d+))?)?", variant)
        if m is None and variant != "specs":
            raise SystemExit(f"variant {variant!r} is neither specs nor ROWSxUNROLL[s][:GROUPS[:MIN_SPLIT]]")
        (S.QMATMUL_SIMD_ROWS, S.QMATMUL_XQ8_SIMD_ROWS, S.QMATMUL_UNROLL, S.QMATMUL_SINGLE_PAIR, S.QMATMUL_SIMD_GROUPS,
         S.QMATMUL_MIN_SPLIT) = defaults
        if m is not None:
            S.QMATMUL_SIMD_ROWS = S.QMATMUL_XQ8_SIMD_ROWS = int(m[1])
            S.QMATMUL_UNROLL, S.QMATMUL_SINGLE_PAIR = int(m[2]), int(bool(m[3]))
            S.QMATMUL_SIMD_GROUPS = int(m[4]) if m[4] else defaults[4]
            S.QMATMUL_MIN_SPLIT = int(m[5]) if m[5] else defaults[5]
        cuda_kernels._functions.cache_clear()
        for decode_matmul in args.decode_matmul:
            kernels = cuda_kernels.CudaKernels(decode_matmul=decode_matmul)
            for label, qtype, rows, K, raws, ids, x, read in tensors:
                calls = [lambda raw=raw, e=e: kernels.qmatmul(x, raw, qtype, K, rows, e) for raw, e in zip(raws, ids)]
                s = graph_seconds(calls, args.repeats) / len(calls)
                r = {"variant": variant, "decode_matmul": decode_matmul, "label": label, "type": qtype.name,
                     "rows": rows, "K": K, "us": s * 1e6, "bytes": read, "fraction_of_copy_bw": read / s / bw}
                out["runs"].append(r)
                print(f"{variant} {decode_matmul:7s}: {label:22s} {qtype.name:8s} {rows:6d} x {K:5d}: "
                      f"{s * 1e6:8.1f} us, {read / 1e6:7.1f} MB, {read / s / 1e12:.2f} TB/s = "
                      f"{100 * r['fraction_of_copy_bw']:.0f}% of copy", flush=True)
    (S.QMATMUL_SIMD_ROWS, S.QMATMUL_XQ8_SIMD_ROWS, S.QMATMUL_UNROLL, S.QMATMUL_SINGLE_PAIR, S.QMATMUL_SIMD_GROUPS,
     S.QMATMUL_MIN_SPLIT) = defaults
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
