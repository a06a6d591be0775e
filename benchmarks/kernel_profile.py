"""Where the GPU time of the CuPy path goes, kernel by kernel, on the full-width Flash slice.

Decode: steps at a context until every layer's halves are CUDA graphs (twelve: those of the steps that end a
ratio-4 window, one in four, are graphs of their own, runtime.tables.ending), then each graph replayed alone
(then the same for the whole step as one graph, the head included)
under PyTorch's profiler (CUPTI sees every kernel of the process, CuPy's included; the lent H200's image
has PyTorch, ds4lab does not need it). Per graph it prints the kernels' summed GPU time against the
replay's (the difference is the gaps between nodes), the node count, and the kernels by time. Then
the output head, and one 2048-token prefill chunk at context ``--prefill-at``, the same way, its kernel
time against its wall time (``--host N``: and the top N host functions of the chunk, from cProfile).

    python benchmarks/kernel_profile.py --context 4096 --json profile.json
    python benchmarks/kernel_profile.py --prefill-only --prefill-at 6144 --host 25 --prefill-matmul f16
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from collections import defaultdict

import numpy as np
from gpu_slice import CHUNK, SLICE, build, filled_state, step, syncer

from ds4lab.config import NANO
from ds4lab.kv.layout import Geometry, new_state
from ds4lab.mlx_kernels.specs import OPERANDS
from ds4lab.testing import model_tensors


def cupy_sync() -> None:
    import cupy as cp

    cp.cuda.get_current_stream().synchronize()


def kernel_times(run, repeats: int, sync=cupy_sync) -> dict:
    """{kernel name: (launches, µs)} per call of ``run``, from ``repeats`` profiled calls; ``sync()`` waits for
    the GPU (CuPy's stream by default; any library's kernels are seen)."""
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile
    except ImportError as e:
        raise SystemExit(f"kernel_profile needs PyTorch's profiler (CUPTI): {e}") from e

    run()
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            run()
        sync()
    per = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            per[e.name][0] += 1
            per[e.name][1] += e.time_range.end - e.time_range.start
    if not per:
        raise SystemExit("the profiler saw no GPU kernels (CUPTI could not trace this process)")
    return {name: (n / repeats, us / repeats) for name, (n, us) in per.items()}


def kernel_sequence(run) -> list:
    """The kernels of one call of ``run`` in order of their start: [name, µs from the first kernel's start, µs]."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    run()
    cupy_sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        cupy_sync()
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == DeviceType.CUDA)
    t0 = spans[0][0] if spans else 0
    return [[name, start - t0, end - start] for start, end, name in spans]


def print_sequence(label: str, seq: list) -> None:
    """Each kernel's start, its gap after the previous one's end, its time and its name."""
    print(f"{label} by start time: start us, gap us, kernel us, name")
    end = 0.0
    for name, start, us in seq:
        print(f"    {start:8.1f} {start - end:6.1f} {us:7.1f}  {name[:100]}")
        end = start + us


def summary(label: str, kernels: dict, wall_us: float | None = None, top: int = 12) -> dict:
    total = sum(us for _, us in kernels.values())
    nodes = sum(n for n, _ in kernels.values())
    line = f"{label}: {nodes:.0f} kernels, {total:.1f} us of kernel time"
    if wall_us is not None:
        line += f" in {wall_us:.1f} us of replay ({wall_us - total:.1f} us between kernels)"
    print(line)
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][1])
    for name, (n, us) in ranked[:top]:
        print(f"    {us:9.1f} us  {n:4.0f}x  {name[:110]}")
    return {"label": label, "kernels": nodes, "kernel_us": total, "replay_us": wall_us,
            "by_kernel": {name: [n, us] for name, (n, us) in ranked}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--config", default="flash", choices=("flash", "nano"))
    p.add_argument("--prefill-matmul", default="float32", choices=OPERANDS,
                   help="the chunk products' operands (the library's default on CuPy is f16)")
    p.add_argument("--decode-matmul", default="float32", choices=("float32", "q8"),
                   help="q8: the decode products on x quantized to int8 per block (ds4lab.load's option)")
    p.add_argument("--prefill-only", action="store_true", help="profile the prefill chunk only")
    p.add_argument("--prefill-at", type=int, default=CHUNK, help="context of the profiled chunk (a multiple of 2048)")
    p.add_argument("--host", type=int, default=0, metavar="N",
                   help="also profile the chunk's host side (cProfile) and print the top N functions")
    p.add_argument("--top", type=int, default=25, help="kernels listed for the eager step and the chunk")
    p.add_argument("--trace", action="store_true",
                   help="also list each graph's kernels by start time, with the gaps between them (each layer "
                        "half's, then the whole step's: its side streams' kernels beside the main stream's)")
    p.add_argument("--no-programmatic", action="store_true",
                   help="launch every kernel as usual, not as a programmatic dependent launch (which starts as the "
                        "kernel before it ends and waits for its writes inside): each kernel's time its own")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)

    import cupy as cp

    if args.no_programmatic:
        from ds4lab.cuda import driver

        driver.PROGRAMMATIC = False

    cfg = SLICE if args.config == "flash" else NANO
    tensors = model_tensors(cfg, seed=0, distinct_rows=8)
    rt = build(cfg, "cupy", True, tensors, args.prefill_matmul, args.decode_matmul)
    sync = syncer(rt.backend)
    stream = cp.cuda.get_current_stream()
    out = {"context": args.context, "graphs": []}

    state = filled_state(rt, args.context, args.context + 40)
    # a graph per layer half (where the time goes), then the whole step's
    for whole in () if args.prefill_only else (False, True):
        rt.whole_step = whole
        rt.compiled.clear()
        for i in range(12):  # eager, capture, replay: of the steps that end a ratio-4 window too
            state, _ = step(rt, np.array([i]), state, sync)
        for key, g in rt.compiled.items():
            for captured, seconds in zip(g._graphs.values(), g.replay_seconds()):
                kernels = kernel_times(lambda: captured.graph.launch(stream), args.repeats)
                out["graphs"].append(summary(f"graph {key}", kernels, seconds * 1e6))
                if args.trace:
                    seq = kernel_sequence(lambda: captured.graph.launch(stream))
                    print_sequence(f"graph {key}", seq)
                    out["graphs"][-1]["sequence"] = seq

    if not args.prefill_only:
        X, _ = rt.forward(np.array([5]), state)
        out["head"] = summary("head (eager)", kernel_times(lambda: rt.model.head(X[-1:]), args.repeats))
        rt.compile = False
        out["decode_eager"] = summary("decode step, eager",
                                      kernel_times(lambda: step(rt, np.array([7]), state, sync), 3), top=args.top)

    at = args.prefill_at
    chunk_state = new_state(cfg, rt.backend, Geometry.for_context(cfg, at + CHUNK + 1, CHUNK))
    for start in range(0, at, CHUNK):
        chunk_state, _ = step(rt, np.arange(start, start + CHUNK) % cfg.n_vocab, chunk_state, sync)
    ids = (np.arange(CHUNK) * 7) % cfg.n_vocab
    kernels = kernel_times(lambda: step(rt, ids, chunk_state, sync), 1)
    walls = []
    for _ in range(3):
        t0 = time.perf_counter()
        step(rt, ids, chunk_state, sync)
        walls.append(time.perf_counter() - t0)
    out["prefill_chunk"] = summary(f"prefill chunk of {CHUNK} at {at}", kernels, min(walls) * 1e6, top=args.top)
    if args.host:  # where the host's time goes in the same chunk
        prof = cProfile.Profile()
        prof.runcall(step, rt, ids, chunk_state, sync)
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.host)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
