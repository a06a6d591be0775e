"""ds4lab with NumPy alone, as under Pyodide: a child interpreter in which ``mlx`` and ``tokenizers`` cannot be
imported, threads and processes cannot start and the home directory does not exist imports ds4lab, loads the
embedded model, and gives the logits and the seeded generation this process gives on the numpy backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import ds4lab

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?"
GENERATE = dict(max_tokens=24, chat=False, temperature=0.8, top_k=40, seed=1234)

# Refuses what Pyodide lacks: the three optional packages (a meta_path finder placed first), threads and processes
# (Pyodide raises RuntimeError and OSError for them). Then it does what the test compares, and says which
# modules it ended up importing.
CHILD = textwrap.dedent("""
    import importlib.abc, json, os, subprocess, sys, threading

    REFUSED = ("mlx", "tokenizers", "threadpoolctl")

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in REFUSED:
                raise ModuleNotFoundError(f"No module named {name!r} (refused by the test)", name=name)
            return None

    def no_thread(self, *a, **k):
        raise RuntimeError("can't start new thread")

    def no_process(self, *a, **k):
        raise OSError(138, "emscripten does not support processes.")

    sys.meta_path.insert(0, Refuse())
    threading.Thread.start = no_thread
    subprocess.Popen.__init__ = no_process
    os.fork = no_process

    import numpy as np
    import ds4lab

    out_dir = sys.argv[1]
    prompt, generate = json.loads(sys.argv[2]), json.loads(sys.argv[3])
    model = ds4lab.load(backend="numpy")
    auto = ds4lab.load()  # backend="auto" without MLX or CuPy
    ids = model.tokenizer.encode(prompt)
    np.save(os.path.join(out_dir, "logits.npy"), model.logits(ids))
    sess = model.session(ctx=256)
    text = sess.generate(prompt, **generate)
    json.dump({"ids": ids, "tokens": list(map(int, sess.tokens)), "text": text, "auto": auto.backend.name,
               "modules": sorted(m for m in sys.modules if m.split(".")[0] in REFUSED + ("cupy",))},
              open(os.path.join(out_dir, "result.json"), "w"))
""")


@pytest.fixture(scope="module")
def child(tmp_path_factory):
    out = tmp_path_factory.mktemp("numpy_alone")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(out / "no-such-home"), "OPENBLAS_NUM_THREADS": "1"}
    env.pop("XDG_CACHE_HOME", None)
    run = subprocess.run([sys.executable, "-c", CHILD, str(out), json.dumps(PROMPT), json.dumps(GENERATE)],
                         env=env, cwd=out, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    assert not (out / "no-such-home").exists(), "something made the home directory"
    return json.loads((out / "result.json").read_text()), np.load(out / "logits.npy"), run.stderr


@pytest.fixture(scope="module")
def model():
    return ds4lab.load(backend="numpy")


def test_nothing_optional_was_imported(child):
    result, _, _ = child
    assert result["modules"] == []


def test_auto_falls_back_to_numpy(child):
    assert child[0]["auto"] == "numpy"


def test_the_pure_tokenizer_gives_this_process_ids(child, model):
    assert child[0]["ids"] == model.tokenizer.encode(PROMPT)


def test_logits_equal_the_numpy_backend(child, model):
    result, logits, _ = child
    expected = model.logits(result["ids"])
    assert logits.shape == expected.shape == (len(result["ids"]), model.config.n_vocab)
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-12)


def test_a_seeded_generation_gives_the_same_tokens(child, model):
    result, _, _ = child
    sess = model.session(ctx=256)
    text = sess.generate(PROMPT, **GENERATE)
    assert len(sess.tokens) == len(model.tokenizer.encode(PROMPT)) + GENERATE["max_tokens"]
    assert result["tokens"] == list(map(int, sess.tokens)) and result["text"] == text


def test_an_explicit_mlx_backend_without_mlx_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlx", None)  # None in sys.modules: the import raises ImportError
    monkeypatch.setitem(sys.modules, "mlx.core", None)
    monkeypatch.delitem(sys.modules, "ds4lab.backends.mlx_backend", raising=False)
    with pytest.raises(ValueError, match="the mlx backend needs MLX"):
        ds4lab.load(backend="mlx")


def test_the_numpy_backend_runs_one_blas_thread_while_a_model_runs(model, monkeypatch):
    """OpenBLAS's threads spin where other processes share the cores (benchmarks/blas_threads.py): the backend's
    scope holds BLAS to one thread while the model computes, and gives the process its own setting back."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    from ds4lab.model import attention

    def blas_threads():
        return [i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]

    if not blas_threads():
        pytest.skip("NumPy here has no BLAS library threadpoolctl can see")
    seen = []
    attend = attention.attend
    monkeypatch.setattr(attention, "attend", lambda *a, **k: seen.append(blas_threads()) or attend(*a, **k))
    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
        logits = model.logits(model.tokenizer.encode(PROMPT))
        assert blas_threads() == [2] * len(blas_threads())
    assert seen and all(t == [1] * len(t) for t in seen), seen
    with threadpoolctl.threadpool_limits(limits=1, user_api="blas"):
        monkeypatch.setattr(type(model.backend), "blas_threads", None)  # the process's own setting, the same logits
        assert np.array_equal(model.logits(model.tokenizer.encode(PROMPT)), logits)
