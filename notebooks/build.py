"""Runs the teaching notebooks from their paired sources and saves their outputs.

    python notebooks/build.py              # every NN_*.py here: execute it, save NN_*.ipynb with its outputs
    python notebooks/build.py 02 05        # only the notebooks whose name starts with 02 or 05
    python notebooks/build.py --no-execute # the .ipynb's cells from the .py, without outputs
    python notebooks/build.py 02 --times   # also print the kernel's wall and CPU seconds of every cell

Each notebook is a jupytext pair (notebooks/jupytext.toml): ``NN_name.py`` in percent format holds the cells
and their tags, ``NN_name.ipynb`` the same cells with the outputs a fresh kernel gave them (committed, so a
saved notebook shows its views' fallbacks and charts). Edit either side (Jupyter with jupytext saves both; by
hand, ``jupytext --sync notebooks/NN_name.py``), then run this to refresh the outputs.

Cells tagged ``nbval-check-output`` are the ones whose outputs nbval compares (``python -m pytest`` runs every
notebook; see notebooks/conftest.py and nbval_sanitize.cfg): keep them to deterministic facts (counts, bytes,
bit-identical checks, seeded samples), never timings.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jupytext
import nbformat
from nbconvert.preprocessors import CoalesceStreamsPreprocessor

HERE = Path(__file__).resolve().parent
CELL_TIMEOUT_S = 120
# ipykernel's own kernelspec: JupyterLab writes the kernel's display name into a notebook it opens, so any other
# name marked every saved notebook modified the moment it was opened
KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}


def sources(prefixes: list[str] = ()) -> list[Path]:
    """The notebooks' paired sources, ``NN_*.py``, whose names start with one of ``prefixes`` (all without)."""
    found = sorted(HERE.glob("[0-9][0-9]_*.py"))
    return [p for p in found if not prefixes or any(p.name.startswith(x) for x in prefixes)]


def cells_of(source: Path):
    """The notebook of ``source`` without outputs; a cell the saved .ipynb already holds keeps its id there, so
    rebuilding changes only what changed."""
    nb = jupytext.read(source)
    nb.metadata = {"kernelspec": KERNELSPEC}
    saved = source.with_suffix(".ipynb")
    if saved.exists():
        ids = {(c.cell_type, c.source): c.get("id") for c in nbformat.read(saved, as_version=4).cells}
        for cell in nb.cells:
            cell.id = ids.get((cell.cell_type, cell.source)) or cell.id
    return nb


def execute(nb) -> tuple[float, list[tuple[float, float]]]:
    """Run ``nb`` in place in a fresh kernel of this interpreter (cwd: notebooks/): the wall seconds, and per code
    cell the kernel's wall and CPU seconds (CPU time, user and system, does not grow when other processes share
    the cores, so it tells what a notebook costs on a busy machine)."""
    import nbclient
    import psutil

    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(HERE)}})
    began, per_cell = {}, []

    def cpu() -> float:
        t = psutil.Process(client.km.provisioner.pid).cpu_times()
        return t.user + t.system + t.children_user + t.children_system

    def start(cell, cell_index):
        began.update(wall=time.perf_counter(), cpu=cpu())

    def done(cell, cell_index, execute_reply):
        per_cell.append((time.perf_counter() - began["wall"], cpu() - began["cpu"]))

    client.on_cell_execute, client.on_cell_executed = start, done
    t0 = time.perf_counter()
    client.execute()
    return time.perf_counter() - t0, per_cell


def main(argv: list[str]) -> None:
    # argparse: a mistyped flag (or --help) is refused before anything is overwritten
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("prefixes", nargs="*", metavar="NN", help="only the notebooks whose name starts with these")
    p.add_argument("--no-execute", action="store_true", help="the .ipynb's cells from the .py, without outputs")
    p.add_argument("--times", action="store_true", help="print the kernel's wall and CPU seconds of every cell")
    args = p.parse_args(argv)
    chosen = sources(args.prefixes)
    if not chosen:
        p.error(f"no notebook source NN_*.py in {HERE} matches {' '.join(args.prefixes)}")
    for source in chosen:
        nb = cells_of(source)
        if not args.no_execute:
            wall, per_cell = execute(nb)
            print(f"{source.stem}: {wall:.1f} s wall; cells: {sum(w for w, _ in per_cell):.1f} s in the kernel, "
                  f"{sum(c for _, c in per_cell):.1f} s of its CPU time", file=sys.stderr)
            code = [c for c in nb.cells if c.cell_type == "code"]
            for i, (cell, (w, c)) in enumerate(zip(code, per_cell), 1) if args.times else ():
                first = cell.source.splitlines()[0][:64] if cell.source else ""
                print(f"  [{i:2d}] {w:5.2f} s, CPU {c:5.2f} s  {first}", file=sys.stderr)
        # one output per stream where the kernel sent several: JupyterLab merges them itself, and re-rendering a
        # trusted notebook's unmerged ones showed a line twice
        CoalesceStreamsPreprocessor().preprocess(nb, {})
        nbformat.write(nb, source.with_suffix(".ipynb"))


if __name__ == "__main__":
    main(sys.argv[1:])
