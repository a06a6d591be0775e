"""What runs under Pyodide (JupyterLite: CPython compiled to WebAssembly, ``sys.platform == "emscripten"``).

There the Python API works on the NumPy backend, and files (``tempfile``, ``KVStore``, ``.kv`` files) live in
the browser tab's in-memory filesystem; processes, threads and listening sockets do not exist. The entry points
that need them call :func:`require_processes` first, so they fail at once with a sentence saying why instead of
deep inside a library.
"""

from __future__ import annotations

import os
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


def available_memory() -> int | None:
    """Bytes of memory this machine can give a process now without swapping (Linux's MemAvailable, else the free
    pages); None where neither can be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None
