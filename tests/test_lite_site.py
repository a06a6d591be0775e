"""The JupyterLite site (lite/build.py) builds offline: it holds the teaching notebooks as saved, ds4lab's wheel
with the embedded model indexed for piplite, and the front ends of the Pyodide kernel and the widgets; the wheel's
requirements on Pyodide are the pure ones. Running the site needs Pyodide's CDN, which this test cannot reach."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import nbformat
import pytest

from tests.test_views_widgets import NO_BACKEND

ROOT = Path(__file__).resolve().parents[1]
EXTENSIONS = {"@jupyterlite/pyodide-kernel-extension", "@jupyter-widgets/jupyterlab-manager", "anywidget"}
PYODIDE = {"sys_platform": "emscripten", "platform_system": "Emscripten", "platform_machine": "wasm32",
           "python_version": "3.14", "python_full_version": "3.14.2"}


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    pytest.importorskip("jupyterlite_core", reason="the site's build needs the lite extra: pip install -e '.[lite]'")
    pytest.importorskip("jupyterlite_pyodide_kernel", reason="the site's build needs the lite extra")
    before = sorted(p.relative_to(ROOT) for p in (ROOT / "lite").rglob("*"))
    out = tmp_path_factory.mktemp("lite") / "site"
    r = subprocess.run([sys.executable, str(ROOT / "lite" / "build.py"), "--no-download", "--output", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=out.parent)
    if r.returncode and NO_BACKEND.search(r.stdout + r.stderr):
        pytest.skip("pip could not install the build backend for an isolated build: " + (r.stdout + r.stderr)[-500:])
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert sorted(p.relative_to(ROOT) for p in (ROOT / "lite").rglob("*")) == before, "the build wrote into lite/"
    return out


def _config(site: Path) -> dict:
    return json.loads((site / "jupyter-lite.json").read_text())["jupyter-config-data"]


def test_the_notebooks_are_served_as_saved(site):
    saved = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert len(saved) >= 6
    assert sorted(p.name for p in (site / "files" / "notebooks").glob("*.ipynb")) == [p.name for p in saved]
    for nb in saved:
        served = json.loads((site / "files" / "notebooks" / nb.name).read_text())
        assert served == nbformat.read(nb, as_version=4), nb.name
        # every multi-line string joined (JupyterLab would show a list of lines with commas between them)
        texts = [c["source"] for c in served["cells"]] + [
            v for c in served["cells"] for o in c.get("outputs", [])
            for v in [o.get("text", ""), *o.get("data", {}).values()] if not isinstance(v, dict)]
        assert not [t for t in texts if isinstance(t, list)], nb.name


def test_the_notebooks_links_open_documents_of_the_site(site):
    """A notebook's link to ../docs/MODEL.md opens the document in the site as in a checkout (notebooks and docs
    in folders of the same names); a student's walk-through found the pointer plain text, since a link would not
    have resolved."""
    from tests.test_notebooks import relative_links

    served = sorted((site / "files" / "notebooks").glob("*.ipynb"))
    links = [(nb.name, link) for nb in served for link in relative_links(nb)]
    assert len(links) >= 4 and {link for _, link in links} >= {"../docs/MODEL.md", "../docs/FORMATS.md"}
    missing = [(name, link) for name, link in links if not (site / "files" / "notebooks" / link).is_file()]
    assert not missing
    assert (site / "files" / "docs" / "MODEL.md").read_bytes() == (ROOT / "docs" / "MODEL.md").read_bytes()
    # and the documents' own links to files of the repository outside docs/ (DISTRIBUTED.md's benchmarks/README.md),
    # and theirs in turn (benchmarks/README.md's ../README.md): every Markdown file served opens its links
    docs = sorted((site / "files" / "docs").glob("*.md"))
    assert len(docs) == len(list((ROOT / "docs").glob("*.md"))) >= 4
    served = sorted((site / "files").rglob("*.md"))
    links = [(doc, link) for doc in served for link in relative_links(doc)]
    assert {"../benchmarks/README.md", "../README.md"} <= {link for _, link in links}
    assert not [(str(doc.relative_to(site)), link) for doc, link in links if not (doc.parent / link).is_file()]
    for name in ("benchmarks/README.md", "README.md"):
        assert (site / "files" / name).read_bytes() == (ROOT / name).read_bytes()


def test_piplite_indexes_the_ds4lab_wheel(site):
    (wheel,) = (site / "pypi").glob("ds4lab-*.whl")
    index = json.loads((site / "pypi" / "all.json").read_text())
    (release,) = [r for files in index["ds4lab"]["releases"].values() for r in files]
    assert release["url"] == f"./{wheel.name}"
    assert release["digests"]["sha256"] == hashlib.sha256(wheel.read_bytes()).hexdigest()
    urls = _config(site)["litePluginSettings"]["@jupyterlite/pyodide-kernel-extension:kernel"]["pipliteUrls"]
    assert any(u.split("?")[0] == "./pypi/all.json" for u in urls), urls


def test_the_wheel_holds_the_model_and_asks_pyodide_only_for_pure_packages(site):
    packaging_markers = pytest.importorskip("packaging.markers")
    packaging_requirements = pytest.importorskip("packaging.requirements")
    (wheel,) = (site / "pypi").glob("ds4lab-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = Parser().parsestr(z.read(meta).decode())
    assert "ds4lab/assets/shakespeare.gguf" in names and "ds4lab/widgets/attention.js" in names
    requirements = [packaging_requirements.Requirement(r) for r in metadata.get_all("Requires-Dist")]
    on_pyodide = {r.name for r in requirements
                  if r.marker is None or r.marker.evaluate({**packaging_markers.default_environment(), **PYODIDE,
                                                            "extra": ""})}
    assert on_pyodide == {"numpy", "gguf", "tqdm"}


def test_the_site_has_the_kernel_and_the_widget_front_ends_only(site):
    loaded = {e["name"] for e in _config(site)["federated_extensions"]}
    assert loaded == EXTENSIONS
    for name in EXTENSIONS:
        assert (site / "extensions" / name / "package.json").is_file(), name
