"""Prefill tokens/s per chunk, decode tokens/s, and the overhead of the session's step objects.

    python benchmarks/session_speed.py [--backend mlx] [--chunk 512] [--tokens 2048] [--decode 64]

The overhead is measured against a bare loop that calls the same step (``Runtime.forward_logits`` on the
same chunks, padded as a prefill's, the head on the last row) without the Prefill/PrefillChunk machinery:
checkpoint handles, row accounting, KV byte accounting and tqdm.
"""

import argparse
import time

import numpy as np

import ds4lab
from ds4lab.cli.common import describe


def bare_prefill(model, ids, ctx, chunk):
    rt, b = model.runtime, model.backend
    state = model.session(ctx=ctx, prefill_chunk=chunk)._state
    step = state.geometry.step
    began = time.perf_counter()
    for start in range(0, len(ids), step):
        logits, state = rt.forward_logits(ids[start:start + step], state, prefill=True)
        b.eval(logits)
        np.asarray(b.to_numpy(logits))
    return time.perf_counter() - began


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="mlx")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--compile", action="store_true", help="compile the attention step (MLX)")
    args = ap.parse_args()
    model = ds4lab.load(backend=args.backend)
    model.runtime.compile = args.compile
    print(describe(model))  # the backend, its device and, on CuPy, whether prefill chunks run on TF32 operands
    ids = np.random.default_rng(0).integers(0, model.config.n_vocab - 7, args.tokens)
    ctx = args.tokens + args.decode + 1

    warm = model.session(ctx=ctx, prefill_chunk=args.chunk)  # traces/converts weights once
    warm.prefill(ids[: args.chunk + 1]).run(progress=False)
    list(warm.decoder(temperature=0).stream(2))

    bare = min(bare_prefill(model, ids, ctx, args.chunk) for _ in range(2))
    timings = []
    for _ in range(2):
        s = model.session(ctx=ctx, prefill_chunk=args.chunk)
        began = time.perf_counter()
        chunks = s.prefill(ids).run(progress=False)
        timings.append(time.perf_counter() - began)
    stepped = min(timings)
    for c in chunks:
        print(f"chunk {c.start:6d}-{c.end:6d}: {c.tokens_per_s:8.1f} tokens/s, KV {c.kv_bytes:,} bytes")
    print(f"prefill {args.tokens} tokens, chunk {args.chunk}: {args.tokens / stepped:.1f} tokens/s "
          f"(bare loop {args.tokens / bare:.1f}); step-object overhead {100 * (stepped / bare - 1):+.1f}%")
    d = s.decoder(temperature=0)
    began = time.perf_counter()
    n = sum(1 for _ in d.stream(args.decode))
    rate = n / (time.perf_counter() - began)
    print(f"decode {n} tokens: {rate:.1f} tokens/s ({args.backend}, compile={args.compile})")


if __name__ == "__main__":
    main()
