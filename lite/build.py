"""Builds the JupyterLite site: the teaching notebooks on a Pyodide kernel, with ds4lab's wheel and the
pure-Python wheels it needs that Pyodide's distribution lacks, served by the site for piplite.

    pip install -e ".[lite]"
    python lite/build.py                  # the site, in lite/_output
    python -m http.server -d lite/_output # serve it
    python lite/build.py --no-download    # offline: ds4lab's wheel only (piplite fetches the rest from PyPI)

What goes in: ``lite/jupyter_lite_config.json``; the notebooks ``notebooks/NN_*.ipynb`` (with their saved outputs)
and the documents they link to, ``docs/*.md``, in folders of the same names, so that a notebook's link to
``../docs/MODEL.md`` opens the document in the site as in a checkout (and the files of the repository those
documents link to, such as ``benchmarks/README.md``, and those these link to, at their paths too);
the front ends of the Pyodide kernel, ipywidgets and anywidget as this environment has them (the environment's
other JupyterLab extensions are left out); ds4lab's wheel built from this checkout; and, unless ``--no-download``,
the wheels in :data:`WHEELS` from PyPI, the widget packages at the versions of their front ends here. Pyodide
itself, NumPy, PyYAML, tqdm and requests come from Pyodide's CDN when the page runs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from importlib.metadata import version
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OUTPUT = HERE / "_output"

# Pure-Python wheels that ds4lab (gguf) and its views (anywidget, with psygnal; ipywidgets, with comm and
# jupyterlab_widgets) need and Pyodide's distribution does not hold. None: the version installed here, so that the
# kernel's package matches the front end copied from this environment.
WHEELS = {"gguf": "0.19.0", "psygnal": "0.16.1", "comm": "0.2.3",
          "anywidget": None, "ipywidgets": None, "jupyterlab_widgets": None}
# The JupyterLab extensions the site gets, from this environment's share/jupyter/labextensions.
EXTENSIONS = ("@jupyterlite/pyodide-kernel-extension", "@jupyter-widgets/jupyterlab-manager", "anywidget")


def notebooks() -> list[Path]:
    found = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    if not found:
        raise SystemExit("no notebooks/NN_*.ipynb to put in the site")
    return found


def relative_links(markdown: str) -> list[str]:
    """The targets of ``markdown``'s links that are paths, not addresses nor anchors, without their fragments."""
    links = re.findall(r"\]\(([^)\s]+)\)", markdown)
    return [link.split("#")[0] for link in links if not re.match(r"[a-z][a-z0-9+.-]*:|#", link)]


def linked_outside_docs() -> list[Path]:
    """The files of the repository outside docs/ and notebooks/ (the site holds those already) that docs/*.md link
    to, and those the Markdown files among them link to in turn, relative to the repository's root."""
    found, todo = set(), sorted((ROOT / "docs").glob("*.md"))
    while todo:
        doc = todo.pop()
        for link in relative_links(doc.read_text(encoding="utf-8")):
            path = (doc.parent / link).resolve()
            inside = path.is_relative_to(ROOT) and not any(path.is_relative_to(ROOT / d) for d in ("docs", "notebooks"))
            if path.is_file() and inside and path.relative_to(ROOT) not in found:
                found.add(path.relative_to(ROOT))
                if path.suffix == ".md":
                    todo.append(path)
    return sorted(found)


def labextension(name: str) -> Path:
    path = Path(sysconfig.get_paths()["data"]) / "share" / "jupyter" / "labextensions" / name
    if not (path / "package.json").is_file():
        raise SystemExit(f"the JupyterLab extension {name} is not installed here ({path}); pip install -e '.[lite]'")
    return path


def run(*cmd: str, cwd: Path | None = None) -> None:
    """Run ``cmd``; one that fails ends the build with one line naming it (its own messages are above it)."""
    print("+", " ".join(cmd), flush=True)
    head = [Path(cmd[0]).name, *cmd[1:3]]  # "python -m pip wheel", "python -m jupyter lite build"
    what = " ".join(head + list(itertools.takewhile(lambda a: not a.startswith("-"), cmd[3:])))
    try:
        subprocess.run(cmd, check=True, cwd=cwd)
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"lite/build.py: error: `{what} ...` failed with exit code {e.returncode} (its messages "
                         "are above; pip install -e '.[lite]' installs what the build needs)") from None
    except OSError as e:
        raise SystemExit(f"lite/build.py: error: `{what} ...` could not start: {e.strerror or e}") from None


def build_wheels(tmp: Path, download: bool) -> list[Path]:
    """ds4lab's wheel, built from a copy of what a build reads (setuptools writes beside its sources) and, when
    ``download``, the :data:`WHEELS` from PyPI, pure-Python ones only; in ``tmp/wheels``."""
    src, wheels = tmp / "src", tmp / "wheels"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("ds4lab", "widgets"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(wheels), str(src))
    if download:
        pins = [f"{name}=={pin or version(name)}" for name, pin in WHEELS.items()]
        run(sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--platform", "any",
            "--implementation", "py", "--abi", "none", "--quiet", "-d", str(wheels), *pins)
    return sorted(wheels.glob("*.whl"))


def build(output: Path, download: bool = True) -> Path:
    """Build the site into ``output`` (replaced); returns it."""
    with tempfile.TemporaryDirectory(prefix="ds4lab-lite-") as tmp:
        wheels = build_wheels(Path(tmp), download)
        contents = Path(tmp) / "contents"
        (contents / "notebooks").mkdir(parents=True)
        for nb in notebooks():
            # Multi-line strings joined, as a Jupyter server serves them: JupyterLite hands the file to JupyterLab as
            # it is, and JupyterLab shows a stream output saved as a list of lines with commas between them.
            (contents / "notebooks" / nb.name).write_text(
                json.dumps(nbformat.read(nb, as_version=4), ensure_ascii=False), encoding="utf-8")
        (contents / "docs").mkdir()
        for doc in sorted((ROOT / "docs").glob("*.md")):
            shutil.copy2(doc, contents / "docs" / doc.name)
        for path in linked_outside_docs():
            (contents / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / path, contents / path)
        if output.exists():
            shutil.rmtree(output)
        cmd = [sys.executable, "-m", "jupyter", "lite", "build", "--lite-dir", str(HERE), "--output-dir", str(output),
               "--contents", str(contents)]
        for ext in EXTENSIONS:
            cmd += ["--LiteBuildConfig.federated_extensions", str(labextension(ext))]
        for wheel in wheels:
            cmd += ["--piplite-wheels", str(wheel)]
        # The cache and doit's state file (.jupyterlite.doit.db, in the working folder) live in the temporary folder:
        # a build leaves nothing in the checkout but the output, and starts from a clean state each time.
        run(*cmd, f"--LiteBuildConfig.cache_dir={Path(tmp) / 'cache'}", cwd=Path(tmp))
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=OUTPUT, help=f"the site's folder (default: {OUTPUT})")
    parser.add_argument("--no-download", action="store_true",
                        help="offline: serve ds4lab's wheel only, no wheels from PyPI")
    args = parser.parse_args(argv)
    print(f"site built in {build(args.output.resolve(), download=not args.no_download)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
