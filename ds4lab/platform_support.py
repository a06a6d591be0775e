"""What runs under Pyodide (JupyterLite: CPython compiled to WebAssembly, ``sys.platform == "emscripten"``).

There the Python API works on the NumPy backend, and files (``tempfile``, ``KVStore``, ``.kv`` files) live in
the browser tab's in-memory filesystem; processes, threads and listening sockets do not exist. The entry points
that need them call :func:`require_processes` first, so they fail at once with a sentence saying why instead of
deep inside a library. And what the machine can give a process: :func:`available_memory`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def in_browser() -> bool:
    """Whether this interpreter is Pyodide (or another Emscripten build of CPython)."""
    return sys.platform == "emscripten"


def require_processes(what: str) -> None:
    """Raise ``RuntimeError`` naming ``what`` when running under Pyodide, which has no processes, threads or
    server sockets."""
    if in_browser():
        raise RuntimeError(f"{what} cannot run in the browser (Pyodide has no processes, threads or server "
                           "sockets); use the Python API there: ds4lab.load(backend='numpy'), model.session(...)")


def available_memory(proc: Path = Path("/proc"), cgroups: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes of memory a process can take now without swapping or being stopped: Linux's MemAvailable, lowered to
    the headroom of a cgroup v2 memory limit (a container's, which is what stops a process there); elsewhere the
    physical memory (macOS gives no cheap "available" figure: an upper bound). None where nothing can be read."""
    try:
        meminfo = (proc / "meminfo").read_text(encoding="ascii")
        have = next(int(line.split()[1]) * 1024 for line in meminfo.splitlines() if line.startswith("MemAvailable:"))
    except (OSError, ValueError, IndexError, StopIteration):
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGESIZE")
        except (AttributeError, OSError, ValueError):
            return None
    try:  # this process's cgroup ("0::/path" in v2), its limit and what it holds
        own = next(line[3:] for line in (proc / "self" / "cgroup").read_text().splitlines() if line.startswith("0::"))
        folder = cgroups / own.strip("/")
        limit = (folder / "memory.max").read_text().strip()
        if limit != "max":
            have = min(have, max(0, int(limit) - int((folder / "memory.current").read_text())))
    except (OSError, ValueError, StopIteration):
        pass
    return have
