"""The teaching notebooks as saved: jupytext pairs (``NN_name.py`` holds the cells, ``NN_name.ipynb`` the same cells
executed, views with static fallbacks), built by notebooks/build.py.

Running them is nbval's job: ``python -m pytest`` also collects notebooks/ (see notebooks/conftest.py), runs
every cell in a fresh kernel and compares the outputs of the cells tagged ``nbval-check-output``.
"""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_views_charts import remote_scripts

nbformat = pytest.importorskip("nbformat")
jupytext = pytest.importorskip("jupytext")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
CHECK = "nbval-check-output"
WIDGET = "application/vnd.jupyter.widget-view+json"
VEGALITE = "application/vnd.vegalite.v5+json"
NAMES = sorted(p.name for p in NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))
SOURCES = sorted(p.name for p in NOTEBOOK_DIR.glob("[0-9][0-9]_*.py"))


def _read(name):
    return nbformat.read(NOTEBOOK_DIR / name, as_version=4)


def _code(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def _cells(nb):
    return [(c.cell_type, c.source, c.metadata.get("tags", [])) for c in nb.cells]


def test_every_notebook_is_a_pair():
    """Each NN_name.ipynb has its NN_name.py and each source its saved notebook, paired by notebooks/jupytext.toml."""
    assert NAMES and [Path(n).stem for n in NAMES] == [Path(s).stem for s in SOURCES]
    config = (NOTEBOOK_DIR / "jupytext.toml").read_text()
    assert 'formats = "ipynb,py:percent"' in config


def test_the_build_command_runs_every_paired_source():
    """notebooks/build.py picks up every NN_*.py, a notebook added later included."""
    spec = importlib.util.spec_from_file_location("notebooks_build", NOTEBOOK_DIR / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    assert [p.name for p in build.sources()] == SOURCES
    assert [p.name for p in build.sources(["02"])] == [s for s in SOURCES if s.startswith("02")]


@pytest.mark.parametrize("name", NAMES)
def test_saved_cells_match_the_paired_source(name):
    """The .py is the cells as text: the saved .ipynb must have the same cells, sources and tags, in order."""
    source = NOTEBOOK_DIR / name.replace(".ipynb", ".py")
    assert source.read_text(encoding="utf-8").startswith("# ---\n# jupyter:"), "not jupytext's percent format"
    assert _cells(_read(name)) == _cells(jupytext.read(source)), \
        f"{name} and its .py differ: jupytext --sync notebooks/{name}, then python notebooks/build.py {name[:2]}"


@pytest.mark.parametrize("name", NAMES)
def test_saved_outputs(name):
    nb = _read(name)
    cells = _code(nb)
    assert all(c.execution_count for c in cells), "not executed top to bottom: run python notebooks/build.py"
    assert [c.execution_count for c in cells] == list(range(1, len(cells) + 1))
    outputs = [o for c in cells for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert not [o for o in outputs if o.output_type == "stream" and o.name == "stderr"], "warnings or progress bars"
    # every live widget carries a static fallback, so the saved notebook still shows it
    bundles = [o.data for o in outputs if "data" in o]
    assert all("text/html" in b for b in bundles if WIDGET in b)
    # nbval compares the tagged cells: each has text to compare
    checked = [c for c in cells if CHECK in c.metadata.get("tags", [])]
    assert checked
    for c in checked:
        texts = [o for o in c.outputs if o.output_type == "stream" or "text/plain" in o.get("data", {})]
        assert texts, f"checked cell without text output: {c.source[:60]!r}"


@pytest.mark.parametrize("name", NAMES)
def test_saved_outputs_load_nothing_from_the_network(name):
    """No output loads a script from a CDN or any http(s) URL (DESIGN.md: no CDN): charts are Vega-Lite
    mimebundles that JupyterLab draws itself (ds4lab.viz.offline_charts), with a PNG for saved notebooks."""
    outputs = [o for c in _code(_read(name)) for o in c.outputs]
    found = remote_scripts([dict(o) for o in outputs])
    assert not found, f"{name}: outputs load scripts from the network: {found[:3]}"
    for o in outputs:
        data = o.get("data", {})
        assert not any("vegalite" in k or "vega." in k for k in data) or VEGALITE in data, list(data)
        if VEGALITE in data:
            assert "text/html" not in data and "image/png" in data, list(data)


def test_views_appear_in_the_notebooks():
    bundles = [o.data for name in NAMES for c in _code(_read(name)) for o in c.outputs if "data" in o]
    assert sum(WIDGET in b for b in bundles) >= 4


def test_pytest_collects_every_notebook_cell_with_nbval():
    pytest.importorskip("nbval")
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "notebooks"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    for name in NAMES:
        n_code = len(_code(_read(name)))
        collected = [line for line in out.stdout.splitlines() if line.startswith(f"notebooks/{name}::Cell ")]
        assert len(collected) == n_code, (name, collected)


# Run last in a notebook's kernel: every live view's fallback as it is now, once every cell has run, by the id of
# the widget a cell displayed (a View's composite widget, or the view's own model).
FINAL_FALLBACKS = """
import gc, json
from ds4lab.viz.base import View, ViewModel
print(json.dumps({getattr(v, "widget", v).model_id: v.static_html() for v in gc.get_objects()
                  if isinstance(v, (View, ViewModel)) and callable(getattr(v, "static_html", None))}))
"""


def _sanitize(text: str) -> str:
    """``text`` after nbval_sanitize.cfg's substitutions (timings, addresses, temporary paths, round-off)."""
    lines = (NOTEBOOK_DIR / "nbval_sanitize.cfg").read_text(encoding="utf-8").splitlines()
    rules = [(a[len("regex: "):], b[len("replace: "):]) for a, b in zip(lines, lines[1:]) if a.startswith("regex: ")]
    for regex, replace in rules:
        text = re.sub(regex, replace, text)
    return text


def _title(html: str) -> str:
    """A fallback's first text, its title (the view's state in a line: tokens, chunks, bytes)."""
    return next(t.strip() for t in re.split(r"<[^>]*>", html) if t.strip())


def _fallbacks(nb) -> list[tuple[str, str]]:
    """(widget model id, static text/html fallback) of every widget output of ``nb``, in order."""
    return [(o.data[WIDGET]["model_id"], o.data["text/html"]) for c in _code(nb) for o in c.outputs
            if WIDGET in o.get("data", {})]


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in NAMES if _fallbacks(_read(n))])
def test_saved_fallbacks_show_the_final_state(name):
    """A saved notebook shows each view's fallback where the live view would be: it must show the state the
    notebook left the view in (later cells step a prefill or move a slider), not the state when first displayed.

    The notebook runs again in a fresh kernel (nbclient); a last cell prints every view's fallback as the final
    state renders it. In that run each widget output's fallback must be that text exactly; and the committed
    notebook's fallbacks must agree with them: same title (after nbval's substitutions) and same text with every
    number masked (the timings in the tables differ from run to run, the structure does not)."""
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nb = jupytext.read(NOTEBOOK_DIR / name.replace(".ipynb", ".py"))
    nb.cells.append(nbformat.v4.new_code_cell(FINAL_FALLBACKS))
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK_DIR)}}).execute()
    final = json.loads(nb.cells[-1].outputs[0]["text"])
    fresh = _fallbacks(nb)
    assert fresh and all(model_id in final for model_id, _ in fresh), "a displayed view is not a ds4lab view"
    for model_id, html in fresh:
        assert html == final[model_id], (f"{name}: a view's fallback shows {_title(html)!r} but the notebook "
                                         f"leaves it at {_title(final[model_id])!r}")
    saved = _fallbacks(_read(name))
    assert len(saved) == len(fresh)
    masked = [(re.sub(r"\d[\d,.]*", "#", _sanitize(a)), re.sub(r"\d[\d,.]*", "#", _sanitize(final[m])))
              for (_, a), (m, _) in zip(saved, fresh)]
    for (_, html), (model_id, _), (a, b) in zip(saved, fresh, masked):
        assert _sanitize(_title(html)) == _sanitize(_title(final[model_id])), \
            f"{name}: the saved fallback shows {_title(html)!r}, its cell's view ends at {_title(final[model_id])!r}"
        assert a == b, f"{name}: the saved fallback of {_title(html)!r} differs from its view's final state"
