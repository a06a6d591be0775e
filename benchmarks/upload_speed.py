"""How fast the weights of a model file reach the GPU: every tensor through ``CupyBackend.device_bytes`` as the
library sets it and at other settings of its upload (threads, piece size), beside the two ceilings: the host
reading the mapped file into pinned buffers alone, and pinned buffers copied to the GPU alone; then the time the
GPU takes to regroup the Q8_0 tensors into the kernels' tiles (``Backend.block_bytes``, part of a model's load).

The first prompt of a fresh process uploads every weight it reads (all of them), so this is most of the cold
start on the whole Flash model (benchmarks/README.md, "flash_short_prompts.py"). Without ``--path`` it writes
the sparse Flash layout (``ds4lab.testing.make_sparse_model``; 81 GiB, a few hundred MB on disk).

    python benchmarks/upload_speed.py [--path /tmp/flash.gguf] [--repeats 2] [--library-only] [--json out]

With ``PYTHONPATH`` at another checkout's ds4lab (``benchmarks/stage_trees.sh``), ``--library-only`` times that
version's upload in the same lease.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from cupy_required import check
from gguf import GGMLQuantizationType as Q

from ds4lab import config, testing
from ds4lab.gguf_file import GGUFModelFile
from ds4lab.mlx_kernels import layout

try:  # without CuPy, --help still reads; main says what is missing
    import cupy as cp

    from ds4lab.backends import cupy_backend
    missing = None
except ImportError as e:
    missing = e

SETTINGS = {  # name -> (UPLOAD_THREADS, PIECE_BYTES)
    "8 threads, 16 MiB pieces": (8, 16 << 20),
    "16 threads, 32 MiB pieces": (16, 32 << 20),
    "16 threads, 64 MiB pieces": (16, 64 << 20),
}


def _upload_all(backend, tensors) -> float:
    t0 = time.perf_counter()
    for raw in tensors:
        backend.device_bytes(raw)  # freed at once: the pool gives its memory to the next tensor
    cp.cuda.Device().synchronize()
    return time.perf_counter() - t0


def _q8_0_tiling(backend, infos) -> float:
    """GPU seconds of the Q8_0 tensors' regrouping into the kernels' tiles (``Backend.block_bytes`` after the
    upload; :mod:`ds4lab.mlx_kernels.layout`), each tensor uploaded first, untimed."""
    seconds = 0.0
    for info in infos:
        if info.qtype != Q.Q8_0:
            continue
        raw = backend.device_bytes(info.data)
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        layout.blocks(raw, info.qtype, cp)
        cp.cuda.Device().synchronize()
        seconds += time.perf_counter() - t0
    return seconds


def _host_reads(tensors, threads: int, piece: int = 64 << 20) -> float:
    """Every tensor's bytes copied from the mapping into pinned buffers, ``threads`` at a time: the host side."""
    buffers = [np.frombuffer(cp.cuda.alloc_pinned_memory(piece), np.uint8, piece) for _ in range(threads)]
    jobs = [(raw.reshape(-1), start) for raw in tensors for start in range(0, raw.nbytes, piece)]

    def read(i: int) -> None:
        src, start = jobs[i]
        m = min(piece, src.nbytes - start)
        np.copyto(buffers[i % threads][:m], src[start:start + m])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:  # job i uses buffer i % threads: no two at once share one
        for k in range(0, len(jobs), threads):
            list(pool.map(read, range(k, min(k + threads, len(jobs)))))
    return time.perf_counter() - t0


def _device_copies(total: int, piece: int = 64 << 20) -> float:
    """``total`` bytes copied from a pinned buffer to the GPU in pieces: the link's side."""
    host = cp.cuda.alloc_pinned_memory(piece)
    dev = cp.empty(piece, dtype=cp.uint8)
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for start in range(0, total, piece):
        dev.data.copy_from_host_async(host.ptr, min(piece, total - start))
    cp.cuda.Device().synchronize()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--path", type=Path, default=Path("/tmp/flash.gguf"))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--library-only", action="store_true", help="only the library's own setting and the ceilings")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    check(missing)
    if not args.path.exists():
        t0 = time.perf_counter()
        testing.make_sparse_model(config.FLASH, args.path, seed=1, filled=testing.routing_filled)
        print(f"wrote {args.path} in {time.perf_counter() - t0:.1f} s", flush=True)
    f = GGUFModelFile.open(args.path)
    tensors = [t.data for t in f.tensors.values()]
    total = sum(t.nbytes for t in tensors)
    small = sum(t.nbytes for t in tensors if t.nbytes <= 64 << 20)
    print(f"{len(tensors)} tensors, {total / 2**30:.1f} GiB ({small / 2**30:.2f} GiB in tensors of 64 MiB or less)",
          flush=True)
    backend = cupy_backend.CupyBackend()
    rows = []

    def record(name: str, seconds: float) -> None:
        rows.append(dict(setting=name, seconds=seconds, gb_per_s=total / seconds / 1e9))
        print(json.dumps(rows[-1]), flush=True)

    default = (cupy_backend.UPLOAD_THREADS, cupy_backend.PIECE_BYTES)
    library = f"the library's ({default[0]} threads, {default[1] >> 20} MiB pieces)"
    record("warm-up: " + library, _upload_all(backend, tensors))  # pages the file in once
    settings = {library: default, **({} if args.library_only else SETTINGS)}
    for _ in range(args.repeats):
        for name, (threads, piece) in settings.items():
            cupy_backend.UPLOAD_THREADS, cupy_backend.PIECE_BYTES = threads, piece
            record(name, _upload_all(backend, tensors))
        for threads in (8, 16):
            record(f"host reads alone, {threads} threads", _host_reads(tensors, threads))
        record("pinned to GPU alone, one stream", _device_copies(total))
    if not args.library_only:  # an older checkout's ds4lab may have no tiles
        q8 = sum(t.nbytes for t in f.tensors.values() if t.qtype == Q.Q8_0)
        seconds = _q8_0_tiling(backend, f.tensors.values())
        rows.append(dict(setting="Q8_0's tiles on the GPU", seconds=seconds, gb_per_s=q8 / seconds / 1e9))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"total_bytes": total, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
