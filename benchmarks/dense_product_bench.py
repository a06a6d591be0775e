"""A chunk's dense products on CuPy under each ``prefill_matmul`` setting, with the half copies they make.

For x of 2048 rows (a prefill chunk) times float32 weights of the shapes a Flash layer multiplies (the HC
mixer's 16384 -> 24, the router's 4096 -> 256, 4096 -> 1024 and 4096 -> 4096), the time of
``CudaKernels.dense_product`` with float32, TF32 and half operands, of rounding x to half by ``round_half`` and by
CuPy's ``astype``, and of the half GEMM alone on operands already rounded. CUDA events around 20 launches after a
warm-up.

    python benchmarks/dense_product_bench.py [--rows 2048] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

from cupy_required import check

from ds4lab.mlx_kernels.specs import OPERANDS

try:  # without CuPy, --help still reads; main says what is missing
    import cupy as cp
    from cupy_backends.cuda.api import runtime
    from cupy_backends.cuda.libs import cublas

    from ds4lab.cuda import CudaKernels
    missing = None
except ImportError as e:
    missing = e

SHAPES = ((16384, 24), (4096, 256), (4096, 1024), (4096, 4096))  # (K, N) of w [N, K]


def timed_us(f, repeats: int = 20) -> float:
    f()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(repeats):
        f()
    end.record()
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / repeats * 1e3


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2048, help="rows of x (a chunk's tokens)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    check(missing)
    rng = cp.random.default_rng(0)
    kernels = {ops: CudaKernels(ops) for ops in OPERANDS}
    rows = []
    for K, N in SHAPES:
        x = rng.standard_normal((args.rows, K), dtype=cp.float32)
        w = rng.standard_normal((N, K), dtype=cp.float32)
        r = {"K": K, "N": N, **{f"{ops}_us": timed_us(lambda k=k: k.dense_product(x, w)) for ops, k in kernels.items()}}
        r["round_half_us"] = timed_us(lambda: kernels["f16"].round_half(x))
        r["astype_f16_us"] = timed_us(lambda: x.astype(cp.float16))
        x16, w16 = x.astype(cp.float16), w.astype(cp.float16)
        r["half_gemm_only_us"] = timed_us(lambda: kernels["f16"]._strided_gemm(
            x16[:, None, :], w16[None], runtime.CUDA_R_16F, K, cublas.CUBLAS_COMPUTE_32F))
        rows.append(r)
        print(f"x {args.rows} x {K} -> {N} rows: " + ", ".join(f"{k[:-3]} {v:.1f} µs" for k, v in r.items()
                                                              if k.endswith("_us")), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows_of_x": args.rows, "shapes": rows}, f, indent=1)


if __name__ == "__main__":
    main()
