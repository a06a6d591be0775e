"""GPU time of choosing the token of a decode step launched ahead (CuPy): the ``next_token`` kernel against the
array library's operations it replaced (``argmax_on_device``, ``sample_on_device``), on a row of Flash's 129,280
logits, greedy and drawn, with one id excluded. CUDA events around ``--repeats`` back-to-back calls each, queued while
the GPU is busy filling a large buffer (so that the events time the GPU, not the host's launches); prints a JSON line
per variant (microseconds a call)."""

from __future__ import annotations

import argparse
import json

import numpy as np


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--vocab", type=int, default=129_280)
    p.add_argument("--repeats", type=int, default=200)
    args = p.parse_args()
    import cupy as cp

    from ds4lab.cuda import CudaKernels
    from ds4lab.sampling import argmax_on_device, draw_params, exclude_mask, sample_on_device

    kernels = CudaKernels()
    logits = cp.asarray((np.random.default_rng(0).standard_normal((1, args.vocab)) * 3).astype(np.float32))
    mask = cp.asarray(exclude_mask([1], args.vocab))
    ids = cp.asarray(np.array([1], np.int32))
    params = cp.asarray(draw_params(np.float32(0.37), 1.0, 0.05))
    variants = {
        "next_token greedy": lambda: kernels.next_token(logits, mask),
        "next_token draw": lambda: kernels.next_token(logits, mask, params),
        "argmax_on_device": lambda: argmax_on_device(cp, logits, ids),
        "sample_on_device": lambda: sample_on_device(cp, logits, np.float32(0.37), 1.0, 0.05, ids),
    }
    busy = cp.empty(1 << 30, dtype=cp.uint8)
    for name, fn in variants.items():
        for _ in range(3):  # compiled, warm
            fn()
        for _ in range(40):  # tens of ms of work queued ahead of the calls
            busy.fill(1)
        began, ended = cp.cuda.Event(), cp.cuda.Event()
        began.record()
        for _ in range(args.repeats):
            fn()
        ended.record()
        ended.synchronize()
        us = cp.cuda.get_elapsed_time(began, ended) * 1e3 / args.repeats
        print(json.dumps({"variant": name, "vocab": args.vocab, "us_per_call": round(us, 2)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
