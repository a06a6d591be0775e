"""The text the notebooks and examples prompt with: the opening of Coriolanus as tinyshakespeare has it (the
embedded model's training text; Shakespeare is in the public domain, data/README.md), carried in the package so
that JupyterLite's notebooks have it too."""

from __future__ import annotations

from functools import lru_cache
from importlib.resources import files

CORIOLANUS_CHARS = 1000  # what the package carries: tinyshakespeare's first 1,000 characters


@lru_cache(maxsize=1)
def _opening() -> str:
    return files("ds4lab.assets").joinpath("coriolanus.txt").read_text(encoding="utf-8")


def coriolanus(chars: int = CORIOLANUS_CHARS) -> str:
    """The first ``chars`` characters of Coriolanus's opening scene ("First Citizen: Before we proceed any
    further, hear me speak. …"), at most :data:`CORIOLANUS_CHARS`."""
    if not 0 < chars <= CORIOLANUS_CHARS:
        raise ValueError(f"chars is {chars}: the package carries the first {CORIOLANUS_CHARS} characters")
    return _opening()[:chars]
