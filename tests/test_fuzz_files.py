"""Fuzzing the files ds4lab reads (GGUF models, ``.kv`` files, ``DSV4`` payloads) with Hypothesis strategies that
know their layouts (tests/fuzz_files.py). The promise: every bad file is refused with an error that names the file
and the key, tensor or field; nothing hangs, crashes, or loads quietly wrong.

* The short run (here, in CI): a few hundred seeded cases (Hypothesis ``derandomize``), each in a worker process
  with a time limit; no crash, hang or silent load, and every refusal names the file (and a key, tensor or field).
* The regressions: every crash, hang and silent load the long run found, as a case of its own.
* The long run: ``python -m pytest -m fuzz`` (sizes from ``DS4LAB_FUZZ_GGUF`` / ``DS4LAB_FUZZ_KV``, default
  5000 / 3000, seed ``DS4LAB_FUZZ_SEED``), or ``python -m tests.fuzz_files --gguf 5000 --kv 3000``; both print
  the table of cases tried, refusals (named), loads unchanged / changed, silent loads, crashes and hangs.
"""

import os

import pytest

from tests.fuzz_files import Mutation, Pool, describe, failed, fuzz, load_layouts, prepare, report, run_case, run_long

N_GGUF, N_KV, N_PAYLOAD = 500, 250, 100  # the short run: ~12 s of cases on 2 cores


@pytest.fixture(scope="module")
def fuzz_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    pool = Pool(root / "seeds", workers=2, work=root / "work")  # the workers start while the seeds are written
    try:
        seeds = prepare(root / "seeds")
        yield pool, seeds, load_layouts(seeds)
    finally:
        pool.close()


def _check(results, n):
    print(report(results))
    assert len(results) >= n * 0.9, f"only {len(results)} of {n} cases ran"
    assert not [r for r in results if failed(r)], report(results)


def test_fuzzed_gguf_files_are_refused_by_name_or_load_intact(fuzz_env):
    pool, seeds, layouts = fuzz_env
    _check(fuzz(pool, seeds, layouts, ("gguf",), N_GGUF), N_GGUF)


def test_fuzzed_kv_files_and_payloads_are_refused_by_name_or_load_intact(fuzz_env):
    pool, seeds, layouts = fuzz_env
    results = fuzz(pool, seeds, layouts, ("kv",), N_KV)
    results += fuzz(pool, seeds, layouts, ("payload",), N_PAYLOAD)
    _check(results, N_KV + N_PAYLOAD)


# -- what the long run found: each a case of the short one -------------------------------------------------------
# (seed, mutation): fields by name (tests/fuzz_files.py's layouts), so they survive a rebuild of the seeds.

REGRESSIONS = {
    # silent: a FLOAT32 key's type id changed to INT32 (or UINT32) reads its 4 bytes as an integer, which the
    # float keys accept: rope.freq_base 10000.0 loads as 1176256512 (in range), another model without an error
    "gguf-float-key-typed-int32": ("tiny", Mutation("set", "kv[deepseek4.rope.freq_base].type", 0, 5)),
    "gguf-float-key-typed-uint32": ("nano", Mutation("set", "kv[deepseek4.attention.compress_rope_freq_base].type",
                                                     0, 4)),
    # hang: an array count raised within the bytes left is read element by element into Python floats (~3 us
    # each, through str()): 4.2M FLOAT32 elements of the 17 MB embedded model take ~12 s before the refusal (and
    # a count damaged in an 81 GiB Flash file, billions of elements, hours and a list of that many floats)
    "gguf-array-count-4.2M": ("embedded", Mutation("set", "kv[deepseek4.swiglu_clamp_exp].count", 0, 4_200_000)),
    # refused without naming the key: a special token's string damaged gives "<file>: tokenizer: tokenizer
    # vocabulary lacks the special token <think>", not the key tokenizer.ggml.tokens
    "gguf-special-token-damaged": ("tiny", Mutation("bytes", "kv[tokenizer.ggml.tokens].elem[381].bytes", 0, b"X")),
    # silent: one damaged byte, the ext flags, turns the CRC check off: with bit 0 (tool map) set and bit 3
    # (checksum) clear, the 8 trailer bytes pass as a tool map and nothing is verified
    "kv-ext-flags-checksum-off": ("kv-tiny-raw", Mutation("set", "kvc.ext", 0, 1)),
    "kv-ext-flags-3": ("kv-embedded-raw", Mutation("set", "kvc.ext", 0, 3)),
    # crash: a load (KVStore.load_into, now Session.load) rewrote the header with hits + 1, which does not fit a
    # u32 (struct.error)
    "kv-hits-max": ("kv-tiny-raw", Mutation("set", "kvc.hits", 0, 2**32 - 1)),
    # crash: `ds4lab inspect` (KVFile.summary) formats created / last_used with time.localtime (OSError, OverflowError)
    "kv-created-2^62": ("kv-tiny-raw", Mutation("set", "kvc.created", 0, 2**62)),
    "kv-last-used-2^64-1": ("kv-tiny-ds4", Mutation("set", "kvc.last_used", 0, 2**64 - 1)),
    # hang: the store's scan opens a FIFO named like an entry and blocks
    "kv-fifo": ("kv-tiny-raw", Mutation("special", "", 0, "fifo")),
    # silent: token ids >= vocab load (a ds4-format file without the checksum; a payload)
    "kv-token-vocab": ("kv-tiny-ds4", Mutation("set", "payload.tokens", 0, 384)),
    "kv-token-max-recrc": ("kv-tiny-raw", Mutation("set", "payload.tokens", 7, 2**32 - 1, recrc=True)),
    "payload-token-vocab": ("payload-tiny", Mutation("set", "payload.tokens", 3, 384)),
    "payload-token-max": ("payload-embedded", Mutation("set", "payload.tokens", 0, 2**32 - 1)),
    # silent: NaN / Inf load in the logits and the KV rows and compressor states (f32 and 8-bit scales)
    "payload-logit-nan": ("payload-tiny", Mutation("set", "payload.logits", 3, float("nan"))),
    "payload-logit-inf": ("payload-embedded", Mutation("set", "payload.logits", 5, float("-inf"))),
    "payload-raw-nan": ("payload-tiny", Mutation("set", "payload.layer[0].raw", 11, float("nan"))),
    "payload-state-inf": ("payload-tiny", Mutation("set", "payload.layer[1].index_state_score", 229, float("-inf"))),
    "kv-comp-inf-recrc": ("kv-tiny-raw", Mutation("set", "payload.layer[1].comp", 0, float("inf"), recrc=True)),
    "kv-logit-nan-ds4": ("kv-tiny-ds4", Mutation("set", "payload.logits", 0, float("nan"))),
    "kv-q8-scale-nan-recrc": ("kv-tiny-q8", Mutation("set", "payload.layer[1].index.scale", 0, float("nan"),
                                                    recrc=True)),
    # refused without naming the file: KVStore.load_into (now Session.load) let the session's PayloadError through
    "kv-other-chunk": ("kv-tiny-raw", Mutation("other-session", "", 0, (256, 32))),
    "kv-prefill-cap-recrc": ("kv-tiny-raw", Mutation("set", "payload.prefill_cap", 0, 32, recrc=True)),
}


# cases that must also be answered quickly (a refusal that takes seconds on a 17 MB file takes hours on Flash's)
SECONDS = {"gguf-array-count-4.2M": 2.0}


@pytest.mark.parametrize("name", REGRESSIONS)
def test_fuzz_regression(fuzz_env, name):
    pool, seeds, layouts = fuzz_env
    r = run_case(pool, layouts, seeds, *REGRESSIONS[name])
    assert not failed(r), describe(r)
    if name in SECONDS:
        assert r["seconds"] < SECONDS[name], f"{r['seconds']} s to answer\n" + describe(r)


@pytest.mark.parametrize("other", ["tiny", "embedded"])
def test_a_kv_file_loaded_into_another_model_is_refused_by_name(fuzz_env, other):
    pool, seeds, layouts = fuzz_env
    model = next(s.path for s in seeds if s.name == other)
    seed = "kv-embedded-raw" if other == "tiny" else "kv-tiny-raw"  # fewer layers, more layers
    r = run_case(pool, layouts, seeds, seed, Mutation("other-model", "", 0, model))
    assert r["outcome"] == "refused" and r["named"], describe(r)


# -- the long run --------------------------------------------------------------------------------------------------

@pytest.mark.fuzz
def test_fuzz_long_run(request, tmp_path):
    """At least 5,000 GGUF and 3,000 .kv / payload cases: 0 crashes, 0 hangs, 0 silent loads, every refusal
    named. Runs only when asked for (``-m fuzz``): it takes minutes."""
    if "fuzz" not in (request.config.option.markexpr or ""):
        pytest.skip("the long fuzz run: python -m pytest -m fuzz (or python -m tests.fuzz_files)")
    n_gguf = int(os.environ.get("DS4LAB_FUZZ_GGUF", 5000))
    n_kv = int(os.environ.get("DS4LAB_FUZZ_KV", 3000))
    results = run_long(n_gguf, n_kv, seed=int(os.environ.get("DS4LAB_FUZZ_SEED", 0)), root=tmp_path)
    text = report(results)
    print(text)
    assert sum(r["family"] == "gguf" for r in results) >= n_gguf * 0.95, text
    assert sum(r["family"] != "gguf" for r in results) >= n_kv * 0.95, text
    assert not [r for r in results if failed(r)], text
