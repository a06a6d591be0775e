"""The full 43-layer Flash layout on a GPU backend: every prompt length 1…N as one chunk, then a decode step.

Short prompts are where a real user starts (and where CuPy once crashed: 3-16 tokens route on the device and
make more than 16 (token, expert) pairs). The file is written sparse on the machine's local disk by
``ds4lab.testing.make_sparse_model`` (81 GiB, a few hundred MB on disk): the embeddings, routers, norms,
hyper-connection and indexer weights are seeded random, so routing differs per token; the experts and the big
projections are holes (zeros).

    python benchmarks/flash_short_prompts.py --backend cupy --max-len 16 [--path /tmp/flash.gguf] [--json out]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import ds4lab
from ds4lab import config, testing


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="cupy")
    p.add_argument("--path", type=Path, default=Path("/tmp/flash.gguf"))
    p.add_argument("--max-len", type=int, default=16)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    began = time.perf_counter()
    if not args.path.exists():
        testing.make_sparse_model(config.FLASH, args.path, seed=1, filled=testing.routing_filled)
    written = time.perf_counter()
    model = ds4lab.load(args.path, backend=args.backend)
    print(f"{model!r}: file written in {written - began:.1f} s, loaded in {time.perf_counter() - written:.1f} s",
          flush=True)
    ids = np.random.default_rng(0).integers(0, model.config.n_vocab - 7, args.max_len)
    rows = []
    for n in range(1, args.max_len + 1):
        t0 = time.perf_counter()
        sess = model.session(ctx=256, prefill_chunk=64)
        sess.prefill(ids[:n]).run(progress=False)
        prefill_s = time.perf_counter() - t0
        step = sess.decoder(seed=0).step()
        row = {"tokens": n, "prefill_s": prefill_s, "decode_s": time.perf_counter() - t0 - prefill_s,
               "finite": bool(np.isfinite(sess.logits).all()), "next": int(step.token)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"backend": model.backend.name, "rows": rows}, indent=1))
    return 0 if all(r["finite"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
