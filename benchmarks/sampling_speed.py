"""Milliseconds per ``sample()`` call at the Flash vocabulary size (129280), per sampling mode.

    python benchmarks/sampling_speed.py
"""

import time

import numpy as np

from ds4lab.sampling import Rng, sample, top_logprobs

CASES = [{}, {"min_p": 0.0}, {"top_p": 0.95}, {"top_p": 0.95, "min_p": 0.0}, {"top_k": 40},
         {"top_k": 1024, "top_p": 0.9, "min_p": 0.0}, {"temperature": 0.0}]

if __name__ == "__main__":
    logits = (np.random.default_rng(3).normal(size=129280) * 2.5).astype(np.float32)
    rng = Rng(1)
    for kw in CASES:
        sample(logits, rng=rng, **kw)
        t0 = time.perf_counter()
        for _ in range(20):
            sample(logits, rng=rng, **kw)
        print(f"{str(kw):45s} {(time.perf_counter() - t0) / 20 * 1e3:7.2f} ms")
    t0 = time.perf_counter()
    top_logprobs(logits, 20)
    print(f"{'top_logprobs(k=20)':45s} {(time.perf_counter() - t0) * 1e3:7.2f} ms")
