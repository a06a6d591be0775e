"""Each decode step's wall time after a frontier, as the sweep runs them (``Decode.step``, steps launched ahead): the
flash_full.py layout file, prefilled to each ``--frontier``, then ``--steps`` greedy steps, each step's time from
the last one's return. Prints the percentiles and the slowest steps with their positions, to tell a slow frontier
made of a few slow steps (a capture, an allocation) from one whose every step is slow.

    python benchmarks/decode_steps.py --layers 30 --frontier 12288 16384 --steps 128
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

import ds4lab
from ds4lab import config

sys.path.insert(0, str(Path(__file__).parent))
from flash_full import FIRST_PROMPT, sparse_file  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--frontier", type=int, nargs="+", default=[12288, 16384])
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--prefill-chunk", type=int, default=None, help="default: the library's")
    p.add_argument("--config", default="flash", choices=("flash", "nano"),
                   help="nano: a small model of the same layout on the numpy backend, to try the script on a CPU")
    p.add_argument("--path", type=Path, default=None, help="the file (default: flash_full.py's)")
    args = p.parse_args(argv)
    cfg = config.FLASH if args.config == "flash" else config.NANO
    if args.layers is not None:
        cfg = config.replace(cfg, n_layer=args.layers)
    path, _ = sparse_file(cfg, args.config, args.layers, args.path)
    backend = "cupy" if args.config == "flash" else "numpy"
    model = ds4lab.load(path, backend=backend, prefill_matmul="f16" if backend == "cupy" else "auto",
                        decode_matmul="q8" if backend == "cupy" else "float32")
    top = max(args.frontier)
    tokens = np.random.default_rng(0).integers(0, model.config.n_vocab - 7, top).tolist()
    warm = model.session(ctx=FIRST_PROMPT + 64, prefill_chunk=args.prefill_chunk)
    warm.prefill(tokens[:FIRST_PROMPT]).run(progress=False)
    d = warm.decoder(temperature=0.0)
    for i in range(32):
        d.step(more=i < 31)
    del warm, d
    sess = model.session(ctx=top + args.steps + 1, prefill_chunk=args.prefill_chunk, max_checkpoints=2)
    eos = model.tokenizer.eos_id
    for frontier in sorted(args.frontier):
        sess.sync(tokens[:frontier])
        snapshot = sess.checkpoint()
        decode = sess.decoder(top=1, exclude=[eos], temperature=0.0)
        times = []
        last = time.perf_counter()
        for i in range(args.steps):
            decode.step(more=i + 1 < args.steps)
            now = time.perf_counter()
            times.append((now - last) * 1e3)
            last = now
        sess.restore(snapshot)
        ms = np.array(times)
        slow = np.argsort(ms)[::-1][:8]
        print(json.dumps({"frontier": frontier, "mean_ms": round(float(ms.mean()), 3),
                          "percentiles_ms": [round(float(v), 3) for v in np.percentile(ms, [10, 50, 90, 99])],
                          "slowest": [(frontier + int(i), round(float(ms[i]), 3)) for i in slow],
                          "by_16": [round(float(ms[j:j + 16].mean()), 3) for j in range(0, len(ms), 16)]}),
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
