"""What of ds4lab can be run under real Pyodide without NumPy: Pyodide's core (the npm package ``pyodide``) under
Node runs ds4lab's tokenizer and platform check, which need only the standard library, and gives the token ids,
chat renderings and decodings CPython gives; every module of the package compiles under its Python. NumPy is not
in that package (Pyodide fetches it from its CDN), so the model itself cannot run here.

Needs ``node`` and the package's folder in ``DS4LAB_PYODIDE`` (``npm install pyodide``, then
``DS4LAB_PYODIDE=$PWD/node_modules/pyodide``); skips otherwise, saying so."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap
import zipfile
from pathlib import Path

import pytest

import ds4lab
from ds4lab.testing import data_file

ROOT = Path(__file__).resolve().parents[1]
CORPUS_CHARS = 100_000  # of each corpus: Pyodide's interpreter is several times slower than CPython
CHATS = [([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Who is Renzo? 婚約者, 1827…"},
           {"role": "assistant", "content": "<think>a man</think>A silk weaver."},
           {"role": "tool", "content": '{"ok": true}'}], "max"),
         ([{"role": "user", "content": "ROMEO:\n\tBut soft!"}], False)]

RUNNER = textwrap.dedent("""
    import { readFileSync, readdirSync } from "node:fs";
    import { pathToFileURL } from "node:url";
    const [pyodideDir, workDir] = process.argv.slice(2);
    const { loadPyodide } = await import(pathToFileURL(pyodideDir + "/pyodide.mjs").href);
    const pyodide = await loadPyodide({ indexURL: pyodideDir + "/" });
    pyodide.FS.mkdirTree("/case");
    for (const name of readdirSync(workDir)) {
        pyodide.FS.writeFile("/case/" + name, readFileSync(workDir + "/" + name));
    }
    console.log(pyodide.runPython(readFileSync(workDir + "/main.py", "utf8")));
""")

# ds4lab/__init__.py imports NumPy, which this Pyodide lacks: the two modules load by file, as modules of their own.
MAIN = textwrap.dedent("""
    import importlib.util, json, pathlib, sys, warnings, zipfile

    def module(name):
        spec = importlib.util.spec_from_file_location(name, f"/case/{name}.py")
        m = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(m)
        return m

    tokenizer, platform_support = module("tokenizer"), module("platform_support")
    case = json.load(open("/case/case.json"))
    tok = tokenizer.Tokenizer(case["tokens"], case["merges"])
    out = {"platform": sys.platform, "in_browser": platform_support.in_browser()}
    out["ids"] = [tok.encode(text) for text in case["texts"]]
    out["decoded"] = [tok.decode(ids) for ids in out["ids"]]
    out["chats"] = [tok.render_chat(messages, think=think) for messages, think in case["chats"]]
    try:
        platform_support.require_processes("ds4lab serve")
    except RuntimeError as e:
        out["refused"] = str(e)
    # every module of the package compiles under Pyodide's Python, a SyntaxWarning counted as a failure
    zipfile.ZipFile("/case/ds4lab.zip").extractall("/case/src")
    sources, failed = sorted(pathlib.Path("/case/src").rglob("*.py")), {}
    for path in sources:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            try:
                compile(path.read_text(encoding="utf-8"), str(path), "exec")
            except (SyntaxError, SyntaxWarning) as e:
                failed[str(path)] = repr(e)
    out["compiled"], out["compile_failures"] = len(sources), failed
    try:
        import numpy  # noqa: F401
        out["numpy"] = True
    except ImportError:
        out["numpy"] = False
    json.dumps(out)
""")


@pytest.fixture(scope="module")
def pyodide_dir() -> Path:
    if shutil.which("node") is None:
        pytest.skip("no node on PATH")
    folder = os.environ.get("DS4LAB_PYODIDE")
    if not folder or not (Path(folder) / "pyodide.mjs").is_file():
        pytest.skip("DS4LAB_PYODIDE does not name the npm package pyodide's folder (npm install pyodide)")
    return Path(folder)


@pytest.fixture(scope="module")
def run(pyodide_dir, tmp_path_factory):
    tok = ds4lab.load(backend="numpy").tokenizer
    texts = [data_file(name).read_text(encoding="utf-8")[:CORPUS_CHARS]
             for name in ("tinyshakespeare.txt", "promessi_sposi.txt")]
    work = tmp_path_factory.mktemp("pyodide")
    for name in ("tokenizer", "platform_support"):
        shutil.copy2(ROOT / "ds4lab" / f"{name}.py", work / f"{name}.py")
    merges = sorted(tok._merge_rank, key=tok._merge_rank.get)
    (work / "case.json").write_text(json.dumps({"tokens": tok.tokens, "merges": merges, "texts": texts,
                                                "chats": CHATS}))
    (work / "main.py").write_text(MAIN)
    with zipfile.ZipFile(work / "ds4lab.zip", "w") as z:
        for path in sorted((ROOT / "ds4lab").rglob("*.py")):
            z.write(path, path.relative_to(ROOT).as_posix())
    runner = work.parent / f"{work.name}-runner.mjs"
    runner.write_text(RUNNER)
    r = subprocess.run(["node", str(runner), str(pyodide_dir), str(work)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    return tok, texts, json.loads(r.stdout.strip().splitlines()[-1])


def test_it_is_pyodide_without_numpy(run):
    _, _, out = run
    assert out["platform"] == "emscripten" and out["in_browser"] is True
    assert out["numpy"] is False


def test_the_tokenizer_gives_cpython_ids_and_text(run):
    tok, texts, out = run
    assert out["ids"] == [tok.encode(text) for text in texts]
    assert out["decoded"] == texts


def test_chat_renderings_equal_cpython(run):
    tok, _, out = run
    assert out["chats"] == [tok.render_chat(messages, think=think) for messages, think in CHATS]


def test_the_entry_points_refuse_there(run):
    assert "ds4lab serve cannot run in the browser" in run[2]["refused"]


def test_every_module_compiles_under_pyodides_python(run):
    out = run[2]
    assert out["compiled"] == len(list((ROOT / "ds4lab").rglob("*.py"))) > 50
    assert out["compile_failures"] == {}
