"""What runs under Pyodide (JupyterLite: CPython compiled to WebAssembly, ``sys.platform == "emscripten"``).

There the Python API works on the NumPy backend, and files (``tempfile``, ``KVStore``, ``.kv`` files) live in
the browser tab's in-memory filesystem; processes, threads and listening sockets do not exist. The entry points
that need them call :func:`require_processes` first, so they fail at once with a sentence saying why instead of
deep inside a library.
"""

from __future__ import annotations

import sys


def in_browser() -> bool:
    """Whether this interpreter is Pyodide (or another Emscripten build of CPython)."""
    return sys.platform == "emscripten"


def require_processes(what: str) -> None:
    """Raise ``RuntimeError`` naming ``what`` when running under Pyodide, which has no processes, threads or
    server sockets."""
    if in_browser():
        raise RuntimeError(f"{what} cannot run in the browser (Pyodide has no processes, threads or server "
                           "sockets); use the Python API there: ds4lab.load(backend='numpy'), model.session(...)")
