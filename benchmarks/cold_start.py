"""The first 2048-token chunk of a fresh process on the Flash slice (CuPy), and what its time is made of.

Starts with an empty CuPy kernel cache (a fresh machine) unless ``--warm`` (then CuPy's default on-disk
cache serves whatever an earlier process compiled). It times every NVRTC compile of the process, ds4lab's
kernels and CuPy's own elementwise and reduction kernels, by wrapping CuPy's compile-with-cache, and
prints the slowest; the rest of the chunk is weight upload and the chunk's own GPU work.

    python benchmarks/cold_start.py --json cold.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import threading
import time


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--warm", action="store_true", help="keep CuPy's kernel cache (default: an empty one)")
    p.add_argument("--top", type=int, default=100, help="list this many of the slowest compiles")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if not args.warm:  # before CuPy is imported: it reads the variable once
        os.environ["CUPY_CACHE_DIR"] = tempfile.mkdtemp(prefix="cupy_cold_")

    import cupy.cuda.compiler as compiler
    import numpy as np
    from gpu_slice import CHUNK, SLICE, build, step, syncer

    from ds4lab.kv.layout import Geometry, new_state
    from ds4lab.mlx_kernels.specs import all_specs
    from ds4lab.testing import model_tensors

    compiles, lock = [], threading.Lock()
    original = compiler._compile_module_with_cache

    def timed(source, *a, **k):
        t0 = time.perf_counter()
        module = original(source, *a, **k)
        names = re.findall(r"__global__\s+void\s+(\w+)", source)
        with lock:
            compiles.append((time.perf_counter() - t0, names[0] if names else "?", t0))
        return module

    compiler._compile_module_with_cache = timed
    tensors = model_tensors(SLICE, seed=0, distinct_rows=8)
    rt = build(SLICE, "cupy", True, tensors)
    sync = syncer(rt.backend)
    t0 = time.perf_counter()
    state = new_state(SLICE, rt.backend, Geometry.for_context(SLICE, CHUNK + 1, CHUNK))
    step(rt, np.arange(CHUNK) % SLICE.n_vocab, state, sync)
    wall = time.perf_counter() - t0
    kernel_names = {s.name for s in all_specs()}
    ours = [c for c in compiles if c[1] in kernel_names]
    theirs = [c for c in compiles if c[1] not in kernel_names]

    def busy(cs):  # wall time with at least one compile running (threads overlap)
        spans = sorted((s, s + d) for d, _, s in cs)
        total, end = 0.0, -1.0
        for a, b in spans:
            total += max(0.0, b - max(a, end))
            end = max(end, b)
        return total

    out = {"cache": "warm" if args.warm else "empty", "first_chunk_s": wall,
           "ds4lab_compiles": len(ours), "ds4lab_compile_s": sum(d for d, *_ in ours),
           "ds4lab_compile_wall_s": busy(ours), "cupy_compiles": len(theirs),
           "cupy_compile_s": sum(d for d, *_ in theirs), "cupy_compile_wall_s": busy(theirs),
           "slowest": [(name, round(d, 3)) for d, name, _ in sorted(compiles, reverse=True)[:args.top]]}
    print(f"first {CHUNK}-token chunk, {out['cache']} kernel cache: {wall:.1f} s")
    print(f"  ds4lab kernels: {len(ours)} compiles, {out['ds4lab_compile_s']:.1f} s of compile time in "
          f"{out['ds4lab_compile_wall_s']:.1f} s of wall time")
    print(f"  CuPy's own kernels: {len(theirs)} compiles, {out['cupy_compile_s']:.1f} s "
          f"({out['cupy_compile_wall_s']:.1f} s of wall time)")
    for name, d in out["slowest"]:
        print(f"    {d:6.3f} s  {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
