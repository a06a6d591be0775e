"""Prefill attention with sinks: the ``attend_chunk`` kernel against the plain ops (``model.attention.attend``:
GEMMs around a materialised [C, H, n_keys] score tensor), at DeepSeek V4 Flash's shapes.

A chunk of C queries is the last C positions of a context of ``n_comp · ratio`` tokens; its keys are a
raw ring of ``--raw`` slots (the latest positions, seen in a causal band of the 128-token window) and
``n_comp`` compressed rows, each seen by the queries its window has ended for (docs/MODEL.md, "Attention"),
as the model builds them. Times are medians after a warm-up, the device synchronised around each call;
GFLOP/s count the useful work (4·D flops per visible (query, key) pair and head), bytes the least a
pass must move (q, keys, mask, out) and the plain path's score tensor.

    python benchmarks/attend_chunk_bench.py                        # CuPy on a GPU, Flash shapes, each form
    python benchmarks/attend_chunk_bench.py --operands f16         # attend_chunk_f16 only
    python benchmarks/attend_chunk_bench.py --backend mlx          # MLX's GPU back-end (CUDA or Metal)
    python benchmarks/attend_chunk_bench.py --config tiny          # the CPU emulator, in seconds
    python benchmarks/attend_chunk_bench.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from ds4lab.mlx_kernels.specs import OPERANDS
from ds4lab.model.attention import attend, raw_visibility, visible_rows

CONFIGS = {
    "flash": dict(C=2048, H=64, D=512, window=128, ratio=4, comp=(1024, 8192), repeat=5),
    "tiny": dict(C=12, H=4, D=64, window=8, ratio=4, comp=(4, 16), repeat=1),
}


def prefill_mask(C: int, n_raw: int, n_comp: int, ratio: int, window: int) -> np.ndarray:
    """Visibility [C, n_raw + n_comp] of a chunk ending at position n_comp·ratio − 1."""
    end = n_comp * ratio
    pos = np.arange(end - C, end)
    slot_pos = (end - 1) - ((end - 1 - np.arange(n_raw)) % n_raw)  # the ring after the chunk's writes
    raw = raw_visibility(np, pos, slot_pos, window)
    comp = np.arange(n_comp)[None, :] < visible_rows(pos, ratio)[:, None]
    return np.concatenate([raw, comp], axis=1)


def backend(name: str):
    """(kernels, to_device, to_host, sync, xp) for CuPy, MLX or the CPU emulator."""
    if name == "cupy":
        import cupy as cp

        from ds4lab.cuda import CudaKernels

        return CudaKernels(), cp.asarray, cp.asnumpy, lambda out: cp.cuda.get_current_stream().synchronize(), cp
    if name == "mlx":
        import mlx.core as mx

        from ds4lab.backends.mlx_backend import float32_gemms
        from ds4lab.mlx_kernels.fast import MLXKernels

        float32_gemms()  # the plain path's GEMMs at float32 precision, as the backend keeps them

        def sync(out):
            mx.eval(out)
            mx.synchronize()

        return MLXKernels(), mx.array, np.array, sync, mx
    from ds4lab.mlx_kernels.cpu import CpuKernels

    return CpuKernels(), np.asarray, np.asarray, lambda out: None, np


def timed(fn, sync, repeat: int) -> tuple[float, object]:
    sync(fn())  # warm-up: compilation, allocations
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        sync(out)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, out


def run_case(kernels, to_dev, to_host, sync, xp, C, H, D, n_raw, n_comp, ratio, window, repeat,
             operands=("float32",)) -> dict:
    rng = np.random.default_rng(0)
    q = to_dev(rng.standard_normal((C, H, D)).astype(np.float32))
    keys = to_dev(rng.standard_normal((n_raw + n_comp, D)).astype(np.float32))
    sinks = to_dev(rng.standard_normal(H).astype(np.float32))
    mask = prefill_mask(C, n_raw, n_comp, ratio, window)
    visible, scale, N = to_dev(mask), D ** -0.5, n_raw + n_comp
    plain_ms, want = timed(lambda: attend(xp, q, keys, visible, sinks, scale), sync, repeat)
    want = to_host(want)
    flops = 4.0 * H * D * float(mask.sum())
    kernel = {}
    for ops in operands:  # the kernel's forms: attend_chunk, _tf32, _f16
        kernels.chunk_operands = ops
        ms, got = timed(lambda: kernels.attend_chunk(q, keys, visible, sinks, scale), sync, repeat)
        kernel[ops] = dict(ms=round(ms, 3), gflops=round(flops / ms / 1e6, 1),
                           plain_over_kernel=round(plain_ms / ms, 3),
                           max_rel_diff=float(np.abs(to_host(got) - want).max() / np.abs(want).max()))
    io_bytes = 4 * (2 * C * H * D + N * D) + C * N
    return dict(C=C, H=H, D=D, n_keys=N, n_raw=n_raw, n_comp=n_comp, visible_fraction=round(float(mask.mean()), 4),
                kernel=kernel, plain_ms=round(plain_ms, 3), plain_gflops=round(flops / plain_ms / 1e6, 1),
                io_bytes=io_bytes, plain_scores_bytes=4 * C * H * N)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("cupy", "mlx", "emulated"), default=None,
                    help="default: cupy for --config flash, the CPU emulator for tiny")
    ap.add_argument("--config", choices=tuple(CONFIGS), default="flash")
    ap.add_argument("--raw", type=int, default=None, help="raw ring slots (default: the window)")
    ap.add_argument("--repeat", type=int, default=None, help="timed calls after the warm-up (default: the config's)")
    ap.add_argument("--operands", nargs="+", choices=OPERANDS, default=OPERANDS,
                    help="the kernel's forms timed (prefill_matmul's settings)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    cfg = CONFIGS[args.config]
    name = args.backend or ("cupy" if args.config == "flash" else "emulated")
    kernels, to_dev, to_host, sync, xp = backend(name)
    n_raw = args.raw or cfg["window"]
    results = []
    for n_comp in cfg["comp"]:
        r = run_case(kernels, to_dev, to_host, sync, xp, cfg["C"], cfg["H"], cfg["D"], n_raw, n_comp, cfg["ratio"],
                     cfg["window"], args.repeat or cfg["repeat"], args.operands)
        results.append(r)
        print(f"C={r['C']} H={r['H']} D={r['D']} keys={n_raw}+{n_comp} (visible {r['visible_fraction']:.0%}): "
              f"plain {r['plain_ms']:.2f} ms ({r['plain_gflops']:.0f} GFLOP/s, scores "
              f"{r['plain_scores_bytes'] / 2**30:.2f} GiB)")
        for ops, k in r["kernel"].items():
            print(f"    kernel {ops:8s} {k['ms']:8.2f} ms ({k['gflops']:.0f} GFLOP/s), plain/kernel "
                  f"{k['plain_over_kernel']:.2f}, max rel diff {k['max_rel_diff']:.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(backend=name, config=args.config, results=results), f, indent=1)


if __name__ == "__main__":
    main()
