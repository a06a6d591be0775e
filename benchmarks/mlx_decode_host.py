"""Where an MLX decode step's time goes: building its lazy graph in Python, against evaluating it (MLX's own
dispatch of each primitive and the GPU's work), with the graph's size by primitive. The model is
``gpu_slice.py``'s full-width Flash slice (or ``--config nano`` to try it on a CPU).

    python benchmarks/mlx_decode_host.py [--context 4096] [--steps 8] [--eager] [--cprofile] [--gpu-kernels]
                                         [--cache-limit BYTES]

A step runs as the backend runs it by default (on a GPU the whole step through ``mx.compile``, traced in the first
step); ``--eager`` runs it op by op. ``--cprofile`` prints the steady steps' costliest Python
functions; ``--gpu-kernels`` the GPU's kernels of a step by time, through PyTorch's profiler (CUPTI sees MLX's
kernels too; ds4lab does not need PyTorch, the lent H200's image has it). ``--cache-limit`` sets MLX's buffer cache
limit first (0: every buffer freed when released, none reused). ``--max-ops-per-buffer N`` sets
``MLX_MAX_OPS_PER_BUFFER`` before anything is evaluated: MLX's CUDA back-end records a stream's launches into a CUDA
graph and commits it every N primitives (or MLX_MAX_MB_PER_BUFFER of inputs; MLX 0.32's defaults per GPU: 100 and
1000 MB on an H100/H200, 20 on most others), each commit a graph to build or update and launch, so N trades the
host's work per step against how soon the GPU starts.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import pstats
import re
import statistics
import tempfile
import time

import mlx.core as mx
import numpy as np
from gpu_slice import NANO, SLICE, build, filled_state

from ds4lab.kv.layout import PackedLayers
from ds4lab.runtime.compiled import present


def state_arrays(state) -> list:
    layers = state.layers
    if isinstance(layers, PackedLayers):
        arrays = layers.arrays
        return list(arrays) if isinstance(arrays, (tuple, list)) else [arrays]
    return [a for layer in layers for a in present(layer)]


def primitives(*outputs) -> collections.Counter:
    """The lazy graph's primitives (MLX's own names) behind ``outputs``, counted."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "step.dot")
        mx.export_to_dot(path, *outputs)
        with open(path) as f:
            return collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle', f.read()))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="flash", choices=("flash", "nano"))
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--eager", action="store_true", help="op by op, nothing compiled")
    p.add_argument("--cprofile", action="store_true", help="the steady steps' 25 costliest Python functions")
    p.add_argument("--gpu-kernels", action="store_true", help="a step's GPU kernels by time (PyTorch's profiler)")
    p.add_argument("--cache-limit", type=int, help="mx.set_cache_limit(BYTES) before anything runs")
    p.add_argument("--max-ops-per-buffer", type=int, metavar="N",
                   help="MLX_MAX_OPS_PER_BUFFER=N before anything is evaluated (MLX reads it once)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.max_ops_per_buffer is not None:
        if args.max_ops_per_buffer < 1:
            p.error(f"--max-ops-per-buffer must be at least 1, not {args.max_ops_per_buffer}")
        os.environ["MLX_MAX_OPS_PER_BUFFER"] = str(args.max_ops_per_buffer)
    if args.cache_limit is not None:
        mx.set_cache_limit(args.cache_limit)

    from ds4lab.testing import model_tensors

    cfg = SLICE if args.config == "flash" else NANO
    rt = build(cfg, "mlx", mx.default_device() == mx.gpu, model_tensors(cfg, seed=0, distinct_rows=8))
    if args.eager:
        rt.compile = False
    state = filled_state(rt, args.context, args.context + 2 * args.steps + 40)
    rng = np.random.default_rng(1)
    prof = cProfile.Profile()
    rows, counts = [], collections.Counter()

    def step(profiling=False, timed=None):
        nonlocal state, counts
        if profiling:
            prof.enable()
        t0 = time.perf_counter()
        logits, state = rt.forward_logits(rng.integers(0, cfg.n_vocab, 1), state)
        t1 = time.perf_counter()
        outs = [logits, *state_arrays(state)]
        if profiling:
            prof.disable()
        if timed is rows and not counts:
            counts = primitives(*outs)
        if profiling:
            prof.enable()
        t2 = time.perf_counter()
        mx.eval(*outs)
        mx.synchronize()
        t3 = time.perf_counter()
        if profiling:
            prof.disable()
        if timed is not None:
            timed.append({"build_s": t1 - t0, "eval_s": t3 - t2, "step_s": (t1 - t0) + (t3 - t2)})

    warm = []
    for i in range(2):  # upload the weights, load the kernels (and trace)
        step(timed=warm)
        print(f"warm-up step {i}: {warm[-1]['step_s']:.2f} s", flush=True)
    for i in range(args.steps):
        step(args.cprofile, rows)
        print(f"step {i}: build {rows[-1]['build_s'] * 1e3:.2f} ms, eval {rows[-1]['eval_s'] * 1e3:.2f} ms", flush=True)
    med = {k: statistics.median(r[k] for r in rows) for k in ("build_s", "eval_s", "step_s")}
    total = sum(counts.values())
    print(f"{args.config}, {cfg.n_layer} layers, context {args.context}, compiled={rt.compile}, "
          f"device {mx.default_device()}: a step {med['step_s'] * 1e3:.2f} ms (build {med['build_s'] * 1e3:.2f}, "
          f"eval {med['eval_s'] * 1e3:.2f}); {med['step_s'] / cfg.n_layer * 1e3:.3f} ms a layer; "
          f"{total} primitives in the graph ({total / cfg.n_layer:.0f} a layer)")
    print("  " + ", ".join(f"{k} {v}" for k, v in counts.most_common(25)))
    out = {"config": args.config, "context": args.context, "compiled": rt.compile,
           "max_ops_per_buffer": os.environ.get("MLX_MAX_OPS_PER_BUFFER"), "median": med, "steps": rows,
           "warm_up": warm, "primitives": dict(counts)}
    if args.gpu_kernels:
        from kernel_profile import kernel_times, summary

        # against the evaluation's time: the GPU has nothing to run while Python builds the graph
        out["gpu_kernels"] = summary("a decode step's GPU kernels", kernel_times(step, 4, mx.synchronize),
                                     med["eval_s"] * 1e6, top=30)
    if args.cprofile:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
