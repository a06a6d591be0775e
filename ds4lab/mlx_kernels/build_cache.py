"""Compiled kernels kept between processes: a file in the temp dir whose name carries a digest of everything
it was built from, so a changed source, compiler or target gets a file of its own."""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path


def kept(name: str, build: Callable[[], bytes]) -> Path:
    """The path of ``name`` in the temp dir, built by ``build`` if it is not there yet. The file appears whole
    or not at all (written aside, then renamed): a concurrent process or thread reads a complete one or
    builds its own."""
    path = Path(tempfile.gettempdir()) / name
    if not path.exists():
        partial = path.with_name(f"{name}.{os.getpid()}.{threading.get_ident()}.partial")
        partial.write_bytes(build())
        os.replace(partial, path)
    return path
