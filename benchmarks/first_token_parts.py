"""Where a fresh process's time to its first generated token goes on the whole Flash layout (CuPy): importing
CuPy and ds4lab, ``ds4lab.load`` (with a profile of it), the session, a one-token prompt (which uploads every
weight) and the first decode step, each on the process's own clock. Run it after a first run has filled CuPy's
kernel cache (``benchmarks/flash_short_prompts.py`` writes the sparse file and does): issue 25's cold start is
measured with a warm cache. The shell's clock around a process also counts its exit (CuPy freeing the weights).

    python benchmarks/first_token_parts.py [--path /tmp/flash.gguf] [--profile]
"""

import time

began = time.perf_counter()  # noqa: E402 (the imports below are what is timed)
import argparse  # noqa: E402
import cProfile  # noqa: E402
import pstats  # noqa: E402

from cupy_required import check  # noqa: E402

try:  # without CuPy, --help still reads; main says what is missing
    import cupy
    missing = None
except ImportError as e:
    missing = e

imported_cupy = time.perf_counter()
import ds4lab  # noqa: E402

imported_ds4lab = time.perf_counter()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--path", default="/tmp/flash.gguf")
    p.add_argument("--profile", action="store_true", help="print the 12 costliest calls of ds4lab.load")
    args = p.parse_args()
    check(missing)
    profile = cProfile.Profile()
    t0 = time.perf_counter()
    with profile:
        model = ds4lab.load(args.path, backend="cupy")
    t1 = time.perf_counter()
    sess = model.session(ctx=256, prefill_chunk=64)
    t2 = time.perf_counter()
    sess.prefill([5]).run(progress=False)
    cupy.cuda.Device().synchronize()
    t3 = time.perf_counter()
    sess.decoder(seed=0).step()
    t4 = time.perf_counter()
    print(f"import cupy {imported_cupy - began:.2f} s, ds4lab {imported_ds4lab - imported_cupy:.2f} s, "
          f"load {t1 - t0:.2f} s, session {t2 - t1:.2f} s, first prompt {t3 - t2:.2f} s, decode {t4 - t3:.2f} s; "
          f"{t4 - began:.2f} s from the first import to the first generated token")
    if args.profile:
        pstats.Stats(profile).sort_stats("cumulative").print_stats(12)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
