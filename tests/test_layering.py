"""The layering of docs/DESIGN.md's card, held by import-linter's contracts in pyproject.toml: formats and the
KV layout at the bottom, the model math only, the runtime, sessions and the store above it, views and the CLI on
top; backends and kernels know no model. ``lint-imports`` prints the import chain of any broken contract."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_import_contracts_hold():
    # A child process run from the repository root: the contracts are checked on this checkout's ds4lab.
    run = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports; "
                          "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True))"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    n = len(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"])
    assert n >= 6 and f"Contracts: {n} kept, 0 broken." in run.stdout, run.stdout[-2000:]
