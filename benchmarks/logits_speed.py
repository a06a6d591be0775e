"""Tokens/s of ``Model.logits`` on the embedded nano model for a 512-token prompt, per backend.

    python benchmarks/logits_speed.py [--tokens 512] [--repeat 3]

Prints one line per backend and numerics mode with the best of ``--repeat`` runs, plus the mlx/numpy
ratio measured in the same run.
"""

import argparse
import time

import numpy as np

import ds4lab


def best_seconds(model, ids, repeat):
    model.logits(ids[:16])  # warm-up: weight conversion, kernel compilation
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        model.logits(ids)
        times.append(time.perf_counter() - start)
    return min(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    for numerics in ("ds4", "exact"):
        rates = {}
        for backend in ("mlx", "numpy"):
            model = ds4lab.load(args.model, backend=backend, numerics=numerics)
            ids = np.random.default_rng(0).integers(0, model.config.n_vocab - 7, args.tokens)
            s = best_seconds(model, ids, args.repeat)
            rates[backend] = args.tokens / s
            print(f"{backend:6s} numerics={numerics:5s} {args.tokens} tokens in {s:.3f} s: "
                  f"{rates[backend]:8.1f} tokens/s")
        print(f"mlx/numpy speed ratio ({numerics}): {rates['mlx'] / rates['numpy']:.2f}")


if __name__ == "__main__":
    main()
