"""For the benchmark scripts that run on CuPy only: they try their GPU imports when imported and keep the error, so
that a machine without CuPy still reads their ``--help``; ``check`` ends a run there with the line that installs it."""

from __future__ import annotations

import sys


def check(missing: ImportError | None) -> None:
    if missing is not None:
        sys.exit(f"{sys.argv[0]}: needs CuPy and an NVIDIA GPU ({missing}): pip install -e '.[cuda]'")
