"""Under Pyodide (``sys.platform == "emscripten"``) the entry points that need processes, threads or server
sockets refuse at once, saying so: the ``ds4lab`` command and ``ds4lab.server``. Setting ``sys.platform`` is
enough to test that: the check reads nothing else. And the memory available, from files written here."""

from __future__ import annotations

import importlib
import sys

import pytest

from ds4lab import default_model_path
from ds4lab.cli import main
from ds4lab.platform_support import in_browser, require_processes

BROWSER = "cannot run in the browser"


@pytest.fixture
def pyodide(monkeypatch):
    monkeypatch.setattr(sys, "platform", "emscripten")


def test_not_in_a_browser_here():
    assert not in_browser()
    require_processes("anything")  # no error


def test_the_check_names_what_was_refused(pyodide):
    assert in_browser()
    with pytest.raises(RuntimeError, match=f"the thing {BROWSER}.*ds4lab.load"):
        require_processes("the thing")


def test_the_command_refuses_before_doing_anything(pyodide, capsys):
    with pytest.raises(RuntimeError, match=f"the ds4lab command {BROWSER}"):
        main(["inspect", str(default_model_path())])
    assert capsys.readouterr() == ("", "")


def test_the_command_runs_elsewhere(capsys):
    assert main(["inspect", str(default_model_path())]) == 0
    assert capsys.readouterr().out


def test_the_server_package_refuses_to_import(pyodide, monkeypatch):
    for name in [m for m in sys.modules if m == "ds4lab.server" or m.startswith("ds4lab.server.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(RuntimeError, match=rf"ds4lab serve \(ds4lab.server\) {BROWSER}"):
        importlib.import_module("ds4lab.server")


def test_available_memory_reads_meminfo_and_a_containers_limit(tmp_path, monkeypatch):
    """MemAvailable, lowered to a cgroup v2 limit's headroom; the physical memory where there is no /proc."""
    from ds4lab.platform_support import available_memory

    proc, cgroups = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (cgroups / "job").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal:       24000000 kB\nMemAvailable:   10485760 kB\n")
    (proc / "self" / "cgroup").write_text("0::/job\n")
    (cgroups / "job" / "memory.max").write_text("max\n")
    assert available_memory(proc, cgroups) == 10 << 30
    (cgroups / "job" / "memory.max").write_text(f"{4 << 30}\n")
    (cgroups / "job" / "memory.current").write_text(f"{1 << 30}\n")
    assert available_memory(proc, cgroups) == 3 << 30
    (cgroups / "job" / "memory.current").write_text(f"{5 << 30}\n")  # past its limit: nothing left
    assert available_memory(proc, cgroups) == 0
    monkeypatch.setattr("os.sysconf", lambda name: {"SC_PHYS_PAGES": 1000, "SC_PAGESIZE": 4096}[name])
    assert available_memory(tmp_path / "none", cgroups) == 4096000  # macOS: no /proc
