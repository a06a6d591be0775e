"""The views' front-end sources, ``widgets/`` at the repository root, and how they ship: every view's model loads
its ESM and the one stylesheet through ``ds4lab.viz.base.widgets_dir`` (in this checkout: its own widgets/);
pyproject.toml installs the folder as the package ``ds4lab.widgets``; a wheel built from the tree holds it and an
editable install maps it, and in both the views load their sources from there. And the views use the public
names of the rest of ds4lab only."""

import ast
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("anywidget")
from ds4lab.viz.attention_view import AttentionModel  # noqa: E402
from ds4lab.viz.base import STYLESHEET, WIDGETS_PACKAGE, widgets_dir  # noqa: E402
from ds4lab.viz.experts import ExpertModel  # noqa: E402
from ds4lab.viz.generation import GenerationModel  # noqa: E402
from ds4lab.viz.kv_view import KVCacheModel  # noqa: E402
from ds4lab.viz.mask_view import MaskModel  # noqa: E402
from ds4lab.viz.prefill_view import PrefillModel  # noqa: E402
from ds4lab.viz.tier_view import TierModel  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WIDGETS = ROOT / "widgets"
MODELS = {"prefill.js": PrefillModel, "kvcache.js": KVCacheModel, "attention.js": AttentionModel, "mask.js": MaskModel,
          "experts.js": ExpertModel, "generation.js": GenerationModel, "tiers.js": TierModel}
# The scripts shared by views (ds4lab.viz.base.widget_module), put before their own ESM.
SHARED = {"kvcache.js": ["hovertip.js", "text.js", "reserve.js"], "attention.js": ["hovertip.js"],
          "tiers.js": ["hovertip.js", "text.js"], "experts.js": ["hovertip.js"], "mask.js": ["hovertip.js", "text.js"],
          "prefill.js": ["hovertip.js", "text.js"], "generation.js": ["text.js", "reserve.js"]}
# What a built or installed ds4lab must show: every model's ESM and stylesheet read from the installed front-end.
CHECK = """
import json, sys
from pathlib import Path
import ds4lab
from ds4lab.viz.base import STYLESHEET, widgets_dir
from ds4lab.viz.experts import ExpertModel
from ds4lab.viz.generation import GenerationModel
from ds4lab.viz.attention_view import AttentionModel
from ds4lab.viz.kv_view import KVCacheModel
from ds4lab.viz.mask_view import MaskModel
from ds4lab.viz.prefill_view import PrefillModel
from ds4lab.viz.tier_view import TierModel
models = {"prefill.js": PrefillModel, "kvcache.js": KVCacheModel, "attention.js": AttentionModel, "mask.js": MaskModel,
          "experts.js": ExpertModel, "generation.js": GenerationModel, "tiers.js": TierModel}
d = widgets_dir()
css = (d / STYLESHEET).read_text()
shared = json.loads('SHARED_JSON')
esm = {name: "".join((d / n).read_text() for n in [*shared.get(name, []), name]) for name in models}
loaded = {name: [m()._esm == esm[name] and "export default" in m()._esm, m()._css == css]
          for name, m in models.items()}
print(json.dumps(dict(ds4lab=ds4lab.__file__, widgets=str(d), loaded=loaded)))
"""
CHECK = CHECK.replace("SHARED_JSON", json.dumps(SHARED))
NO_BACKEND = re.compile(r"No matching distribution|Could not find a version|Failed to establish|Network is unreachable|"
                        r"Temporary failure in name resolution|ProxyError", re.I)


def _front_end_files(folder) -> set[str]:
    return {p.name for p in folder.iterdir() if p.name.endswith((".js", ".css"))}


def test_every_view_loads_its_esm_and_the_stylesheet_through_widgets_dir():
    d = widgets_dir()
    assert Path(str(d)) == WIDGETS  # a checkout shows its own front-end
    css = (d / STYLESHEET).read_text()
    for name, model in MODELS.items():
        m = model()
        esm = "".join((d / n).read_text() for n in [*SHARED.get(name, []), name])
        assert m._esm == esm and "export default" in m._esm, name
        assert m._css == css, f"{name}'s model does not carry the shared stylesheet"
    # one ESM per view, the scripts they share and one stylesheet: nothing else, nothing missing, and no copy left in
    # the package
    assert _front_end_files(WIDGETS) == set(MODELS) | {STYLESHEET} | {n for names in SHARED.values() for n in names}
    assert not (ROOT / "ds4lab" / "viz" / "static").exists()


def test_pyproject_ships_every_package_and_the_widgets():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {p.parent for p in (ROOT / "ds4lab").rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    tree = {".".join(p.relative_to(ROOT).parts) for p in folders}
    assert set(cfg["packages"]) == tree | {WIDGETS_PACKAGE}, "pyproject.toml's packages do not list the tree's"
    assert cfg["package-dir"] == {WIDGETS_PACKAGE: "widgets"}
    globs = cfg["package-data"][WIDGETS_PACKAGE]
    assert all(any(fnmatch.fnmatch(n, g) for g in globs) for n in _front_end_files(WIDGETS))


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """A copy of what a build reads (pyproject.toml, README.md, ds4lab/, widgets/), so that no build writes here."""
    src = tmp_path_factory.mktemp("tree") / "ds4lab-src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("ds4lab", "widgets"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return src


def _pip(*args, cwd) -> None:
    """pip in this interpreter; skips when the build backend (setuptools, from pyproject.toml) cannot be had."""
    r = subprocess.run([sys.executable, "-m", "pip", *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"))
    if r.returncode and NO_BACKEND.search(r.stdout + r.stderr):
        pytest.skip("pip could not install the build backend for an isolated build: " + (r.stdout + r.stderr)[-500:])
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]


def _check(python, cwd, env) -> dict:
    r = subprocess.run([python, "-c", CHECK], cwd=cwd, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_built_wheel_ships_the_front_end_and_its_views_load_it(tree, tmp_path):
    _pip("wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(tree), cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("ds4lab-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        z.extractall(tmp_path / "site")
    assert {f"ds4lab/widgets/{n}" for n in _front_end_files(WIDGETS)} <= names
    assert not [n for n in names if n.startswith("ds4lab/viz/static/")]
    # the unpacked wheel first on the path, run from elsewhere: the package's own copy is what the views load
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    got = _check(sys.executable, tmp_path, env)
    assert Path(got["ds4lab"]).is_relative_to(tmp_path / "site")
    assert Path(got["widgets"]) == tmp_path / "site" / "ds4lab" / "widgets"
    assert got["loaded"] == {name: [True, True] for name in MODELS}


def test_an_editable_install_maps_the_front_end(tree, tmp_path):
    """``pip install -e`` (what binder/requirements.txt does) in a bare venv that sees this interpreter's packages:
    the views load the checkout's widgets/, and importlib.resources finds the same folder as ds4lab.widgets."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python"))
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # this interpreter's packages (numpy, anywidget, ...) after the venv's own: a path, whose .pth files do not run
    here = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    Path(site, "here.pth").write_text("\n".join(here) + "\n")
    _pip("--python", python, "install", "--no-deps", "-q", "-e", str(tree), cwd=tmp_path)
    got = _check(python, tmp_path, {k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert Path(got["ds4lab"]) == tree / "ds4lab" / "__init__.py"
    assert Path(got["widgets"]) == tree / "widgets"
    assert got["loaded"] == {name: [True, True] for name in MODELS}
    r = subprocess.run([python, "-c", f"import importlib.resources as r; print(r.files({WIDGETS_PACKAGE!r}))"],
                       cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0 and Path(r.stdout.strip()) == tree / "widgets", r.stderr[-2000:]


# -- public names only ----------------------------------------------------------------------------------------
def _private(name: str) -> bool:
    """A private name: one underscore first, not a dunder, and not IPython's display protocol (_repr_*_)."""
    return name.startswith("_") and not name.endswith("__") and not re.fullmatch(r"_repr_\w+_", name)


def test_views_use_public_names_only():
    """No module of ds4lab/viz imports a private name (from another module of ds4lab or elsewhere), or reaches
    a private attribute of an object other than ``self``, ``cls`` or ``super()`` (sessions, prefills, captures,
    widgets)."""
    found = []
    for path in sorted((ROOT / "ds4lab" / "viz").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            where = f"{path.name}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                parts = (node.module or "").split(".") + [a.name for a in node.names]
                found += [f"{where} imports {p}" for p in parts if _private(p)]
            elif isinstance(node, ast.Import):
                found += [f"{where} imports {a.name}" for a in node.names if any(map(_private, a.name.split(".")))]
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                own |= isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "super"  # self's too
                if not own:
                    found.append(f"{where} reaches {ast.unparse(node)}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                    "getattr", "hasattr", "setattr") and len(node.args) > 1:
                name = node.args[1]
                if isinstance(name, ast.Constant) and isinstance(name.value, str) and _private(name.value):
                    found.append(f"{where} reaches {ast.unparse(node)}")
    assert not found, found


def test_a_prefill_view_has_one_slider_that_drives_its_kv_view(model_paths):
    """The PrefillView's slider is the one control of the chunk shown: the KV view it makes shows no slider of its
    own, whatever it scrubs through (its widget does not hold it); a KV view given keeps its slider, and moved onto
    one of the chunks, the whole PrefillView shows that chunk."""
    import ds4lab
    from ds4lab.viz import KVCacheView, PrefillView

    model = ds4lab.load(model_paths["nano"], backend="numpy")
    ids = [(i * 7 + 3) % (model.config.n_vocab - 10) + 5 for i in range(100)]
    view = PrefillView(model.session(ctx=256, prefill_chunk=32), ids)
    kv = view.kv_view
    assert not kv.has_slider and kv.slider not in kv.widget.children
    view.run()  # scrub_through the 4 chunks: still no slider shown
    assert kv.slider.layout.display == "none" and len(kv.checkpoints) == 4
    view.slider.value = 1
    assert kv.model.data["label"] == "after chunk 1 (tokens 32–63)" and view.model.selected == 1
    assert view.mask_view.model.label.startswith("chunk 1")
    # a KV view of one's own, given: its slider shows, and moving it moves the PrefillView with it
    sess = model.session(ctx=256, prefill_chunk=32)
    mine = KVCacheView(sess)
    other = PrefillView(sess, ids, kv_view=mine)
    other.run()
    assert mine.has_slider and mine.slider in mine.widget.children and mine.slider.layout.display is None
    mine.slider.value = 2
    assert other.model.selected == 2 and other.slider.value == 2 and "after chunk 2" in other.state.value
    assert mine.model.data["label"] == "after chunk 2 (tokens 64–95)"
    assert other.mask_view.model.label.startswith("chunk 2")
    other.slider.value = 0
    assert mine.slider.value == 0 and mine.model.data["n_tokens"] == 32
    # a standalone KV view keeps its slider, hidden only with nothing to scrub
    alone = KVCacheView(sess, checkpoints=other.chunks)
    assert alone.slider.layout.display is None and KVCacheView(sess).slider.layout.display == "none"
