"""The full-width Flash slice of gpu_slice.py split over two GPUs with CuPy: the same logits as one GPU,
and the time spent in tier switches as a fraction of the step, for decode and for 2048-token chunks.

    python benchmarks/tier_split.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_slice import CHUNK, SLICE, build, filled_state, syncer  # noqa: E402

from ds4lab import Placement  # noqa: E402
from ds4lab.config import NANO  # noqa: E402
from ds4lab.kv.layout import Geometry, new_state  # noqa: E402
from ds4lab.testing import model_tensors  # noqa: E402
from ds4lab.tiers import TierRun  # noqa: E402


def run_steps(rt, placement, state, batches, mode, sync):
    """Evaluate each token batch in turn with ``placement`` on the runtime ``rt``; returns per-step logits,
    seconds, switch seconds and bytes."""
    b = rt.backend
    state = placement.place_state(state)
    active, out = placement.embed_tier, []
    for i, tokens in enumerate(batches):
        run = TierRun(placement, mode, i, active)
        sync()
        t0 = time.perf_counter()
        logits, state = rt.forward_logits(tokens, state, tiers=run, prefill=mode == "batch")
        with run.scope():
            sync(logits)
        seconds = time.perf_counter() - t0
        active = run.active
        out.append(dict(logits=b.to_numpy(logits)[0], seconds=seconds,
                        switch_s=sum(s.seconds for s in run.switches), bytes=sum(s.bytes for s in run.switches),
                        switches=len(run.switches)))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json")
    p.add_argument("--config", default="flash", choices=("flash", "nano"))
    p.add_argument("--decode-ctx", type=int, default=4096)
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--chunks", type=int, default=3)
    args = p.parse_args(argv)
    cfg = SLICE if args.config == "flash" else NANO
    tensors = model_tensors(cfg, seed=0, distinct_rows=8)
    plans = {"one GPU": Placement.single("cuda:0"), "two GPUs": Placement.even(2, devices=["cuda:0", "cuda:1"])}
    rng = np.random.default_rng(0)
    decode_tokens = [rng.integers(0, cfg.n_vocab, 1) for _ in range(args.decode_steps + 2)]
    chunk_tokens = [rng.integers(0, cfg.n_vocab, CHUNK) for _ in range(args.chunks)]
    results = {}
    for name, plan in plans.items():
        rt = build(cfg, "cupy", True, tensors)
        sync = syncer(rt.backend)
        model = SimpleNamespace(config=cfg, backend=rt.backend, file=rt.model.weights.file)
        dstate = filled_state(rt, args.decode_ctx, args.decode_ctx + len(decode_tokens) + 8)
        placement = plan.resolve(model, dstate)
        decode = run_steps(rt, placement, dstate, decode_tokens, "decode", sync)[2:]  # after upload/compile
        pstate = new_state(cfg, rt.backend, Geometry.for_context(cfg, CHUNK * args.chunks + 1, CHUNK))
        prefill = run_steps(rt, placement, pstate, chunk_tokens, "batch", sync)[1:]
        results[name] = dict(placement=repr(placement), decode=decode, prefill=prefill)
        print(placement, flush=True)
        for kind, steps in (("decode", decode), ("prefill chunk", prefill)):
            s = np.median([x["seconds"] for x in steps])
            sw = np.median([x["switch_s"] for x in steps])
            print(f"  {kind}: step {s * 1e3:.2f} ms, switches {sw * 1e3:.3f} ms = {100 * sw / s:.2f}% "
                  f"({steps[0]['switches']} switch(es), {steps[0]['bytes']:,} bytes)", flush=True)
        del rt
    one, two = results["one GPU"], results["two GPUs"]
    summary = {}
    for kind in ("decode", "prefill"):
        a = np.stack([x["logits"] for x in one[kind]])
        b = np.stack([x["logits"] for x in two[kind]])
        summary[kind] = dict(identical=bool(np.array_equal(a, b)), max_abs_diff=float(np.abs(a - b).max()),
                             switch_fraction=float(np.median([x["switch_s"] / x["seconds"] for x in two[kind]])))
        print(f"{kind}: logits identical on one and two GPUs: {summary[kind]['identical']} "
              f"(max |diff| {summary[kind]['max_abs_diff']:.3g}); switches take "
              f"{100 * summary[kind]['switch_fraction']:.2f}% of the two-GPU step", flush=True)
    if args.json:
        for r in results.values():
            for steps in (r["decode"], r["prefill"]):
                for x in steps:
                    x.pop("logits")
        with open(args.json, "w") as f:
            json.dump(dict(results=results, summary=summary), f, indent=1)


if __name__ == "__main__":
    main()
