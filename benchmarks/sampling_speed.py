"""Milliseconds per ``sample()`` call at the Flash vocabulary size (129280), per sampling mode, and for the
log-probabilities a :class:`ds4lab.session.Decode` step reports: the host's share of every generated
token, on top of the step's GPU work (about 2 ms for the 6-layer slice on an H200).

    python benchmarks/sampling_speed.py
"""

import argparse
import time

import numpy as np

from ds4lab.sampling import Rng, sample, token_and_top_logprobs

CASES = [{}, {"min_p": 0.0}, {"top_p": 0.95}, {"top_p": 0.95, "min_p": 0.0}, {"top_k": 40},
         {"top_k": 1024, "top_p": 0.9, "min_p": 0.0}, {"temperature": 0.0}]
REPEATS = 20


def ms_per_call(fn) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(REPEATS):
        fn()
    return (time.perf_counter() - t0) / REPEATS * 1e3


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # no options; --help says what it does
    logits = (np.random.default_rng(3).normal(size=129280) * 2.5).astype(np.float32)
    rng = Rng(1)
    ms = {str(kw): ms_per_call(lambda: sample(logits, rng=rng, **kw)) for kw in CASES}
    token = int(np.argsort(logits)[-20])  # outside the top 5
    ms["token_and_top_logprobs(k=5)"] = ms_per_call(lambda: token_and_top_logprobs(logits, token, 5))
    ms["a default Decode.step: sample + logprobs"] = ms[str({})] + ms["token_and_top_logprobs(k=5)"]
    for name, t in ms.items():
        print(f"{name:45s} {t:7.2f} ms")
