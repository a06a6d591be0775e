"""The teaching notebooks as saved: built from notebooks/_build.py, executed, views with static fallbacks.

Running them is nbval's job: ``python -m pytest`` also collects notebooks/ (see notebooks/conftest.py), runs
every cell in a fresh kernel and compares the outputs of the cells tagged ``nbval-check-output``.
"""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_views_charts import remote_scripts

nbformat = pytest.importorskip("nbformat")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
CHECK = "nbval-check-output"
WIDGET = "application/vnd.jupyter.widget-view+json"
VEGALITE = "application/vnd.vegalite.v5+json"


def _builder():
    spec = importlib.util.spec_from_file_location("notebooks_build", NOTEBOOK_DIR / "_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BUILD = _builder()
NAMES = list(BUILD.NOTEBOOKS)


def _read(name):
    return nbformat.read(NOTEBOOK_DIR / name, as_version=4)


def _code(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def test_every_notebook_comes_from_the_builder():
    saved = sorted(p.name for p in NOTEBOOK_DIR.glob("*.ipynb"))
    assert saved == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_saved_cells_match_the_builder(name):
    """Edit notebooks/_build.py, then run it: the saved notebook must have the builder's cells."""
    built, saved = BUILD.build(name), _read(name)
    assert [(c.cell_type, c.source, c.metadata.get("tags", [])) for c in saved.cells] == \
        [(c.cell_type, c.source, c.metadata.get("tags", [])) for c in built.cells], \
        f"{name} is stale: run python notebooks/_build.py {name[:2]}"


@pytest.mark.parametrize("name", NAMES)
def test_saved_outputs(name):
    nb = _read(name)
    cells = _code(nb)
    assert all(c.execution_count for c in cells), "not executed top to bottom: run python notebooks/_build.py"
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
