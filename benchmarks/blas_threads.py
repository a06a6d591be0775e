"""The NumPy backend with one BLAS thread against the process's own setting, on the embedded model: prefill and
decode tokens/s, alone and with ``--busy N`` processes spinning beside it (as a notebook's browser and server, or
pytest's other workers, share a small machine's cores). One line per setting and round, alternated.

    python benchmarks/blas_threads.py [--rounds 3] [--busy 0 2] [--prompt-tokens 1500] [--decode 32]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from pathlib import Path

import ds4lab
from ds4lab.backends.numpy_backend import NumpyBackend

TEXT = Path(__file__).resolve().parent.parent / "data" / "tinyshakespeare.txt"


def spin():
    while True:
        pass


def measure(model, ids, n_decode: int) -> tuple[float, float]:
    s = model.session(ctx=2048, prefill_chunk=512)
    t = time.perf_counter()
    s.sync(ids)
    prefill = len(ids) / (time.perf_counter() - t)
    t = time.perf_counter()
    list(s.decoder(temperature=0).stream(n_decode))
    return prefill, n_decode / (time.perf_counter() - t)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--busy", type=int, nargs="+", default=[0, 2], help="spinning processes beside the run")
    p.add_argument("--prompt-tokens", type=int, default=1500)
    p.add_argument("--decode", type=int, default=32)
    args = p.parse_args(argv)
    model = ds4lab.load(backend="numpy")
    ids = model.tokenizer.encode(TEXT.read_text()[:40000])[:args.prompt_tokens]
    measure(model, ids[:64], 4)  # warm-up
    for busy in args.busy:
        spinners = [mp.Process(target=spin, daemon=True) for _ in range(busy)]
        for proc in spinners:
            proc.start()
        try:
            results = {1: [], None: []}
            for _ in range(args.rounds):
                for threads in results:
                    NumpyBackend.blas_threads = threads
                    results[threads].append(measure(model, ids, args.decode))
        finally:
            for proc in spinners:
                proc.terminate()
        for threads, runs in results.items():
            pre = statistics.median(r[0] for r in runs)
            dec = statistics.median(r[1] for r in runs)
            label = "1 BLAS thread" if threads == 1 else "BLAS as set  "
            print(f"busy {busy}: {label} prefill {pre:7.1f} t/s, decode {dec:6.1f} t/s "
                  f"(median of {len(runs)}; rounds: " + ", ".join(f"{a:.0f}/{b:.1f}" for a, b in runs) + ")")


if __name__ == "__main__":
    main()
