"""Under Pyodide (``sys.platform == "emscripten"``) the entry points that need processes, threads or server
sockets refuse at once, saying so: the ``ds4lab`` command and ``ds4lab.server``. Setting ``sys.platform`` is
enough to test that: the check reads nothing else."""

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
