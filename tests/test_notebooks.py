"""The teaching notebooks as saved: jupytext pairs (``NN_name.py`` holds the cells, ``NN_name.ipynb`` the same cells
executed, views with static fallbacks), built by notebooks/build.py.

Running them is nbval's job: ``python -m pytest`` also collects notebooks/ (see notebooks/conftest.py), runs
every cell in a fresh kernel and compares the outputs of the cells tagged ``nbval-check-output``.
"""

import html
import importlib.util
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


def relative_links(path: Path) -> list[str]:
    """The targets of a saved notebook's markdown links (or a Markdown file's) that are paths, not addresses (nor a
    cell's anchors)."""
    if path.suffix == ".md":
        texts = [path.read_text(encoding="utf-8")]
    else:
        texts = [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "markdown"]
    links = [m for text in texts for m in re.findall(r"\]\(([^)\s]+)\)", text)]
    return [link.split("#")[0] for link in links if not re.match(r"[a-z][a-z0-9+.-]*:|#", link)]


@pytest.mark.parametrize("name", NAMES)
def test_links_to_files_resolve_in_the_checkout(name):
    """A notebook points to the docs by a link (the walk-through's "docs/MODEL.md" was plain text): each relative
    link names a file of the repository, from the notebook's folder (lite/build.py keeps the same layout)."""
    missing = [link for link in relative_links(NOTEBOOK_DIR / name) if not (NOTEBOOK_DIR / link).is_file()]
    assert not missing


def test_every_notebook_is_a_pair():
    """Each NN_name.ipynb has its NN_name.py and each source its saved notebook, paired by notebooks/jupytext.toml."""
    assert NAMES and [Path(n).stem for n in NAMES] == [Path(s).stem for s in SOURCES]
    config = (NOTEBOOK_DIR / "jupytext.toml").read_text()
    assert 'formats = "ipynb,py:percent"' in config


def build_module():
    """notebooks/build.py as a module (it is a script, not a package's)."""
    spec = importlib.util.spec_from_file_location("notebooks_build", NOTEBOOK_DIR / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    return build


def test_the_build_command_runs_every_paired_source():
    """notebooks/build.py picks up every NN_*.py, a notebook added later included."""
    build = build_module()
    assert [p.name for p in build.sources()] == SOURCES
    assert [p.name for p in build.sources(["02"])] == [s for s in SOURCES if s.startswith("02")]


def test_the_build_command_refuses_what_it_does_not_know(monkeypatch, capsys):
    """--help and a mistyped flag or prefix stop notebooks/build.py before it writes a notebook (it once took any
    "--" word as nothing and rebuilt every notebook)."""
    build = build_module()
    monkeypatch.setattr(build, "execute", lambda nb: pytest.fail("a notebook was run"))
    monkeypatch.setattr(build.nbformat, "write", lambda *a: pytest.fail("a notebook was written"))
    for argv, code, said in ((["--help"], 0, "--no-execute"), (["--no-exec"], 2, "unrecognized arguments: --no-exec"),
                             (["99"], 2, "matches 99")):
        with pytest.raises(SystemExit) as e:
            build.main(argv)
        out = capsys.readouterr()
        assert e.value.code == code and said in out.out + out.err, (argv, out)


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
    # one output per stream a cell: JupyterLab showed a trusted notebook's second stdout output's line twice on
    # reopening it (notebooks/build.py merges them)
    for c in cells:
        names = [o.name for o in c.outputs if o.output_type == "stream"]
        assert len(names) == len(set(names)), f"a stream in several outputs: {c.source[:60]!r}"
    # nbval compares the tagged cells: each has text to compare
    checked = [c for c in cells if CHECK in c.metadata.get("tags", [])]
    assert checked
    for c in checked:
        texts = [o for o in c.outputs if o.output_type == "stream" or "text/plain" in o.get("data", {})]
        assert texts, f"checked cell without text output: {c.source[:60]!r}"


# characters: a student at 1280x800 with JupyterLab's file browser open has a notebook column about 850 px wide,
# which shows about 100 characters of code or of printed text; longer code lines were cut off, longer printed ones
# wrapped in the middle of numbers and words
WIDTH = 100


def _printed(output) -> str | None:
    """What ``output`` shows as plain text: a stream's text, or the text/plain of a value shown as nothing else
    (a widget or an HTML view has its own layout, and JupyterLab shows its HTML, not its text/plain)."""
    if output.output_type == "stream":
        return output.text
    data = output.get("data", {})
    if "text/plain" in data and "text/html" not in data and WIDGET not in data:
        return data["text/plain"]
    return None


@pytest.mark.parametrize("name", NAMES)
def test_saved_lines_fit_a_narrow_notebook_column(name):
    """No code line and no printed line of a saved notebook is longer than WIDTH characters."""
    long = []
    for n, cell in enumerate(_code(_read(name))):
        where = f"{name}, code cell {n} (In [{cell.execution_count}])"
        texts = [("code", cell.source)] + [("output", t) for t in map(_printed, cell.outputs) if t is not None]
        for what, text in texts:
            long += [f"{where}, {what} line {i}: {len(line)} characters: {line[:70]!r}…"
                     for i, line in enumerate(text.splitlines(), 1) if len(line) > WIDTH]
    assert not long, f"{len(long)} lines over {WIDTH} characters:\n" + "\n".join(long)


@pytest.mark.parametrize("name", NAMES)
def test_saved_outputs_load_nothing_from_the_network(name):
    """No output loads a script from a CDN or any http(s) URL (DESIGN.md: no CDN): charts are Vega-Lite
    mimebundles that JupyterLab draws itself (ds4lab.viz.vegalite), with a PNG for saved notebooks."""
    outputs = [o for c in _code(_read(name)) for o in c.outputs]
    found = remote_scripts([dict(o) for o in outputs])
    assert not found, f"{name}: outputs load scripts from the network: {found[:3]}"
    for o in outputs:
        data = o.get("data", {})
        assert not any("vegalite" in k or "vega." in k for k in data) or VEGALITE in data, list(data)
        if VEGALITE in data:
            assert "text/html" not in data and "image/png" in data, list(data)


def _drawn_texts(spec: dict) -> list[str]:
    """The texts of a Vega-Lite chart as Vega draws them (vl-convert's SVG): titles and tick labels, in order."""
    vlc = pytest.importorskip("vl_convert")
    return [html.unescape(t) for t in re.findall(r"<text[^>]*>([^<]*)</text>", vlc.vegalite_to_svg(spec))]


@pytest.mark.parametrize("name", NAMES)
def test_saved_charts_tick_labels_read_as_values(name):
    """No tick of a saved chart reads as zero with an SI prefix: an axis format "~s" gives every tick the largest
    one's prefix (notebook 05's bytes moved read 0M, 0.5M, 1M); its bytes axis is in the binary units of its text
    and of TierView (it read 500 kB, 1 MB beside "1.2 MiB")."""
    specs = [o.data[VEGALITE] for c in _code(_read(name)) for o in c.outputs if VEGALITE in o.get("data", {})]
    bytes_axes = 0
    for spec in specs:
        texts = _drawn_texts(spec)
        assert not [t for t in texts if re.fullmatch(r"-?0(\.\d+)?\s?[kMGTPmµn]B?", t)], (name, texts)
        if name.startswith("05_") and "bytes moved" in texts:
            ticks = ["0", "256 KiB", "512 KiB", "768 KiB", "1 MiB", "1.25 MiB"]
            assert texts[texts.index("bytes moved") - len(ticks) : texts.index("bytes moved")] == ticks, texts
            bytes_axes += 1
    assert bytes_axes == name.startswith("05_"), f"{name}: {bytes_axes} charts with a bytes moved axis"


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


def _notebook_conftest():
    """notebooks/conftest.py as a module (not a package's: loaded by its path)."""
    spec = importlib.util.spec_from_file_location("ds4lab_notebooks_conftest", NOTEBOOK_DIR / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fallback_check_refuses_a_view_that_moved_on():
    """notebooks/conftest.py's check (run by nbval after each notebook's last cell): a displayed fallback must be
    its view's final one, and the committed fallbacks must match them up to numbers."""
    nc = _notebook_conftest()
    view = "<div><b>KV cache: 96 tokens, 1,234 bytes</b><table><tr><td>12.5 ms</td></tr></table></div>"
    later = view.replace("96 tokens", "160 tokens")
    nc.check_fallbacks("x.ipynb", [("a", view)], [("m", view)], {"m": view})
    nc.check_fallbacks("x.ipynb", [("a", view.replace("12.5 ms", "13.1 ms"))], [("m", view)], {"m": view})
    with pytest.raises(AssertionError, match="shows 'KV cache: 96 tokens, 1,234 bytes' but the notebook leaves it "
                                             "at 'KV cache: 160 tokens, 1,234 bytes'"):
        nc.check_fallbacks("x.ipynb", [("a", view)], [("m", view)], {"m": later})
    with pytest.raises(AssertionError, match="the saved fallback shows 'KV cache: 160 tokens"):
        nc.check_fallbacks("x.ipynb", [("a", later)], [("m", view)], {"m": view})
    with pytest.raises(AssertionError, match="differs from its view's final state"):
        nc.check_fallbacks("x.ipynb", [("a", view.replace("<td>", "<td><i>"))], [("m", view)], {"m": view})
    with pytest.raises(AssertionError, match="0 views saved, 1 displayed"):
        nc.check_fallbacks("x.ipynb", [], [("m", view)], {"m": view})
    with pytest.raises(AssertionError, match=r"no live ds4lab view is left of the displayed \['KV cache: 96"):
        nc.check_fallbacks("x.ipynb", [("a", view)], [("m", view)], {})


@pytest.mark.slow
def test_nbval_fails_a_notebook_whose_view_moves_on_after_display(tmp_path):
    """End to end: nbval with notebooks/conftest.py runs a notebook whose view follows its session past the cell
    that displayed it; the notebook's last cell fails, saying which state the fallback shows and which it ends at."""
    pytest.importorskip("nbval")
    for f in ("conftest.py", "nbval_sanitize.cfg"):
        (tmp_path / f).write_text((NOTEBOOK_DIR / f).read_text(encoding="utf-8"), encoding="utf-8")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in (
        "import ds4lab\nfrom ds4lab.viz import KVCacheView\nmodel = ds4lab.load(backend='numpy')\n"
        "sess = model.session(ctx=64, prefill_chunk=16)\nsess.prefill(list(range(3, 19))).run(progress=False)\n"
        "view = KVCacheView(sess, follow=True)\nview",
        "sess.prefill(list(range(3, 35))).run(progress=False)  # the prompt grows by 16 tokens")])
    nbformat.write(nb, tmp_path / "moves_on.ipynb")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                          "moves_on.ipynb"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "1 failed, 1 passed" in out.stdout and "moves_on.ipynb::Cell 1" in out.stdout
    assert "shows 'KV cache of the session: 16 tokens" in out.stdout
    assert "but the notebook leaves it at 'KV cache of the session: 32 tokens" in out.stdout
