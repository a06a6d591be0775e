"""Command-line papercuts of issue 21 (items 3, 5 and 7), each held by a test that failed before its fix.

Most cases run ``ds4lab`` on the embedded default model with the NumPy backend (small and fast); the errors
expected before any work are checked to come before the run's header line and with nothing on stdout.
"""

import errno
import inspect
import io
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import ds4lab
import ds4lab.backends as backends
from ds4lab import cli
from ds4lab.backends import cuda_device_label, device_label, resolve_backend
from ds4lab.cli import DEFAULT_SYSTEM
from ds4lab.cli import common as cli_common
from ds4lab.cli.common import NamedWrites, describe
from tests.test_cli import FAST, STATS, ds4lab_cmd, one_error_line


@pytest.fixture(scope="module")
def model():
    return ds4lab.load(backend="numpy")


def no_work_started(proc):
    """The error came before the model ran: no header line, no CSV, no progress."""
    assert proc.stdout == "", proc.stdout
    assert "prefill:" not in proc.stderr and "bench: " not in proc.stderr, proc.stderr


# -- item 3: the run header names the GPU -----------------------------------------------------------------

def _fake_model(backend):
    return SimpleNamespace(path=Path("flash.gguf"), config=SimpleNamespace(n_layer=43, n_vocab=129280),
                           backend=backend)


def test_run_header_names_the_cuda_gpu():
    cupy = SimpleNamespace(name="cupy", device="cuda:0", device_label=cuda_device_label(0, b"NVIDIA H200"))
    assert describe(_fake_model(cupy)).endswith("cupy on cuda:0 (NVIDIA H200)")
    # a backend with the device index only, MLX's GPU and CPU devices, NumPy
    assert describe(_fake_model(SimpleNamespace(name="cupy", device="cuda:1"))).endswith("cupy on cuda:1")
    assert device_label(SimpleNamespace(name="mlx", device="Device(gpu, 0)")) == "gpu"
    assert device_label(SimpleNamespace(name="mlx", device="Device(cpu, 0)")) == "cpu"
    assert device_label(SimpleNamespace(name="numpy")) == "cpu"


def test_cuda_device_label_formats_index_and_name():
    """What CupyBackend stores as ``device_label`` from the CUDA runtime's (index, name)."""
    assert cuda_device_label(0, b"NVIDIA H200") == "cuda:0 (NVIDIA H200)"
    assert cuda_device_label(3, "NVIDIA H200\0\0\0".encode()) == "cuda:3 (NVIDIA H200)"
    assert cuda_device_label(1, " Tesla T4 ") == "cuda:1 (Tesla T4)"
    assert cuda_device_label(2, None) == cuda_device_label(2, b"") == "cuda:2"


# -- item 5: one backend rule for load() and the command line -------------------------------------------

def test_load_defaults_to_auto_like_the_command_line(model):
    assert inspect.signature(ds4lab.load).parameters["backend"].default == "auto"
    assert "auto" in ds4lab.load.__doc__ and "resolve_backend" in ds4lab.load.__doc__
    for module in (cli, cli_common):  # the package and the module that loads the model
        assert not hasattr(module, "_resolve_backend") and not hasattr(module, "_cupy_has_gpu")
    chosen = resolve_backend("auto")
    m = ds4lab.load()
    assert m.backend.name == chosen and f"backend={chosen}," in repr(m)
    assert ds4lab.load(backend="auto").backend.name == chosen
    assert ds4lab.load(device="cpu").backend.name == "numpy"  # the CLI's --device cpu rule


@pytest.mark.parametrize("mlx_gpu, metal, cupy_gpu, device, want", [
    (False, False, False, None, "numpy"),
    (False, False, True, None, "cupy"),
    (True, True, False, None, "mlx"),  # an Apple GPU
    (True, False, True, None, "cupy"),  # MLX's CUDA build beside CuPy: CuPy's path first
    (True, False, False, None, "mlx"),  # MLX's CUDA build alone
    (True, False, True, "gpu", "mlx"),
    (True, False, False, "cpu", "numpy"),
    (False, False, False, "cuda:1", "cupy"),
])
def test_auto_resolution(monkeypatch, mlx_gpu, metal, cupy_gpu, device, want):
    monkeypatch.setattr(backends, "mlx_has_gpu", lambda: mlx_gpu)
    monkeypatch.setattr(backends, "mlx_has_metal", lambda: metal)
    monkeypatch.setattr(backends, "cupy_has_gpu", lambda: cupy_gpu)
    assert resolve_backend("auto", device) == want
    for name in ("numpy", "cupy"):
        assert resolve_backend(name) == name
    assert resolve_backend("mlx", "cpu") == "mlx"


def test_auto_resolution_errors(monkeypatch):
    monkeypatch.setattr(backends, "mlx_has_gpu", lambda: False)
    with pytest.raises(ValueError, match="unknown backend 'bogus'; choose auto or one of mlx, numpy, cupy"):
        resolve_backend("bogus")
    with pytest.raises(RuntimeError, match="MLX has no GPU here"):
        resolve_backend("mlx", "gpu")


def test_the_command_line_resolves_through_the_same_function(monkeypatch, capsys):
    calls = []
    real = backends.resolve_backend

    def spy(name="auto", device=None):
        calls.append((name, device))
        return real("numpy", None)

    monkeypatch.setattr(backends, "resolve_backend", spy)
    assert cli.main(["run", "-p", "ROMEO:", "-n", "1", "--temp", "0", "--ctx", "64"]) == 0
    assert calls[0] == ("auto", None)
    assert "numpy on cpu" in capsys.readouterr().err


# -- item 7: files checked before any work, errors that name them -----------------------------------------

def test_bench_plot_into_a_missing_folder_fails_before_the_sweep(tmp_path):
    target = tmp_path / "missing" / "x.html"
    proc = ds4lab_cmd("bench", "--plot", target, *FAST)
    line = one_error_line(proc, 1)
    assert f"--plot {target}: the folder {target.parent} does not exist" in line
    no_work_started(proc)


@pytest.mark.parametrize("case", ["directory", "missing-folder", "proc"])
def test_bench_csv_path_is_checked_first_and_named(case, tmp_path):
    target = {"directory": tmp_path, "missing-folder": tmp_path / "nope" / "out.csv",
              "proc": Path("/proc/version")}[case]
    if case == "proc" and not target.is_file():
        pytest.skip("no /proc/version here")
    proc = ds4lab_cmd("bench", "--csv", target, *FAST)
    line = one_error_line(proc, 1)
    assert f"--csv {target}: " in line
    why = {"directory": "is a directory", "missing-folder": "does not exist", "proc": "cannot write there"}[case]
    assert why in line
    no_work_started(proc)


def test_csv_write_errors_name_the_file(tmp_path):
    class Broken:
        def write(self, text):
            raise OSError(5, "Input/output error")

        def flush(self):
            raise OSError(5, "Input/output error")

    out = NamedWrites(Broken(), tmp_path / "x.csv")
    for write in (lambda: out.write("a,b\n"), out.flush):
        with pytest.raises(OSError) as e:
            write()
        assert (e.value.errno, e.value.strerror, e.value.filename) == (5, "Input/output error", str(tmp_path / "x.csv"))


class _FullDisk(io.StringIO):
    """A stdout on a full disk: writes are kept until a flush, which fails as a full disk's does."""

    def flush(self):
        if self.getvalue():
            raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("command", [["inspect", str(ds4lab.default_model_path())],
                                     ["run", "-p", "ROMEO:", "-n", "2", "--temp", "0", *FAST]])
def test_a_full_disk_on_stdout_is_named(command, monkeypatch, capsys):
    # the run's text fails at its first token's flush, inspect's table at the command's end (named_stdout's flush,
    # before the interpreter's exit): both reported by name, exit 1
    monkeypatch.setattr(sys, "stdout", _FullDisk())
    assert cli.main(command) == 1
    assert capsys.readouterr().err.splitlines()[-1] == "ds4lab: error: stdout: No space left on device"


def test_a_command_started_with_stdout_closed_runs(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdout", None)  # what Python gives a process started with `>&-`
    assert cli.main(["inspect", str(ds4lab.default_model_path())]) == 0
    assert capsys.readouterr().err == ""


def test_a_closed_pipe_on_stdout_is_still_quiet(monkeypatch, capsys):
    class Closed(_FullDisk):
        def write(self, text):
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", Closed())
    monkeypatch.setattr(os, "dup2", lambda *a: None)  # main points the real stdout at /dev/null
    monkeypatch.setattr(Closed, "fileno", lambda self: 1, raising=False)
    assert cli.main(["inspect", str(ds4lab.default_model_path())]) == 1
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("content", ["", "  \n", "ROMEO: too short"])
def test_bench_prompt_file_problems_come_before_the_csv_header(content, tmp_path):
    text = tmp_path / "prompt.txt"
    text.write_text(content)
    proc = ds4lab_cmd("bench", "--prompt-file", text, "--ctx-start", 32, "--ctx-max", 64, "-n", 2, *FAST)
    line = one_error_line(proc, 1)
    assert str(text) in line
    assert ("the file is empty" if not content.strip() else "need at least --ctx-max (64)") in line
    assert proc.stdout == ""  # no CSV header before the error


def test_bench_missing_prompt_file_and_model_are_named(tmp_path):
    for flag in ("--prompt-file", "-m"):
        proc = ds4lab_cmd("bench", flag, tmp_path / "absent", *FAST)
        assert f"{flag} {tmp_path / 'absent'}: no such file" in one_error_line(proc, 1)
        no_work_started(proc)


def test_prompt_that_leaves_nothing_to_generate_is_an_error(model):
    n = len(model.tokenizer.encode("ROMEO:"))
    ctx = n + 1  # the prompt fits, but ds4 keeps the last slot free: nothing would be generated
    proc = ds4lab_cmd("run", "-p", "ROMEO:", "--ctx", ctx, "--temp", 0, *FAST)
    line = one_error_line(proc, 1)
    assert f"the prompt has {n} tokens and the context holds {ctx}: nothing is left to generate" in line
    assert f"use --ctx {n + 2} or more" in line
    assert proc.stdout == ""
    # one more slot: one token, as the message says
    proc = ds4lab_cmd("run", "-p", "ROMEO:", "--ctx", n + 2, "--temp", 0, *FAST)
    assert proc.returncode == 0, proc.stderr
    assert STATS.search(proc.stderr).group(5) == "1"
    # longer prompts get the same message
    assert "the context holds 3: nothing is left" in one_error_line(
        ds4lab_cmd("run", "-p", "ROMEO: a longer prompt", "--ctx", 3, *FAST), 1)


def test_interactive_turn_that_leaves_nothing_to_generate(model):
    ids = model.tokenizer.render_chat([{"role": "system", "content": DEFAULT_SYSTEM},
                                       {"role": "user", "content": "Hello"}], think=False)  # no chat template
    proc = ds4lab_cmd("run", "--ctx", len(ids) + 1, "-n", 2, *FAST, input="Hello\n/stats\n/quit\n")
    assert proc.returncode == 0, proc.stderr
    assert (f"this turn (the transcript and the new message) has {len(ids)} tokens and the context holds "
            f"{len(ids) + 1}: nothing is left to generate") in proc.stderr
    assert f"use /ctx {len(ids) + 2} or more" in proc.stderr
    assert f"session: 0/{len(ids) + 1} tokens" in proc.stdout  # the turn was refused before the prefill


def test_inspect_a_file_that_is_neither_gguf_nor_kvc(tmp_path):
    path = tmp_path / "notes.md"
    path.write_text("# doc\n")
    line = one_error_line(ds4lab_cmd("inspect", path), 1)
    assert f"{path}: neither a GGUF model nor a KVC cache file" in line
    assert "b'GGUF'" in line and "b'KVC'" in line and "b'# do'" in line
    empty, loop = tmp_path / "empty.kv", tmp_path / "loop"
    empty.write_bytes(b"")
    loop.symlink_to(loop)
    assert one_error_line(ds4lab_cmd("inspect", empty), 1).endswith(
        f"{empty}: the file is empty (0 bytes): neither a GGUF model nor a KVC cache file")  # was "starts with b''"
    assert one_error_line(ds4lab_cmd("inspect", loop), 1).endswith(
        f"{loop}: a symbolic link to nothing (or a loop of links)")  # was "no such file"


def test_kv_summary_says_what_the_quant_byte_means_and_escapes_the_text_once(model, tmp_path):
    from ds4lab.kv.store import routed_quant_bits

    text = "First Citizen:\nBefore we proceed any further, hear me speak."
    sess = model.session(ctx=128, prefill_chunk=64)
    sess.sync(model.tokenizer.encode(text))
    # the embedded model's routed experts are Q8_0: ds4 (and KVStore) write quant byte 2 for them
    assert model.file.tensors["blk.0.ffn_gate_exps.weight"].qtype.name == "Q8_0" and routed_quant_bits(model) == 2
    entry = ds4lab.KVStore(tmp_path, min_tokens=1).save(sess.snapshot(), sess.model)
    proc = ds4lab_cmd("inspect", entry.path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "2-bit" not in out
    assert "model quant byte 2 (routed experts not Q4_K: ds4 writes 4 for Q4_K experts, 2 for any other type)" in out
    assert f"text: {text!r}\n" in out  # 'First Citizen:\nBefore…': one backslash
    assert "\\\\n" not in out


def test_make_model_error_names_the_requested_path(tmp_path):
    target = tmp_path / "missing" / "x.gguf"
    line = one_error_line(ds4lab_cmd("make-model", "-o", target), 1)
    assert str(target) in line and ".tmp" not in line


def test_every_subcommand_help_has_a_description(capsys):
    parser = cli.build_parser()
    commands = next(a.choices for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    assert set(commands) == {"run", "serve", "bench", "inspect", "make-model"}
    for name, sub in commands.items():
        assert sub.description, name
        with pytest.raises(SystemExit):
            cli.main([name, "--help"])
        help_text = " ".join(capsys.readouterr().out.split())
        assert " ".join(sub.description.split()) in help_text, name


@pytest.mark.parametrize("argv, named", [(["--bogus"], "--bogus"), (["--bogus", "run", "-p", "x"], "--bogus"),
                                         (["-x", "--also"], "-x --also")])
def test_unknown_options_before_the_command_are_named(argv, named, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"unrecognized arguments: {named} (see --help)" in err
    assert len(err.strip().splitlines()) == 1


def test_think_max_on_plain_text_says_so(capsys):
    assert cli.main(["run", "-p", "ROMEO:", "--think-max", "-n", "1", "--temp", "0", "--ctx", "64", *FAST]) == 0
    err = capsys.readouterr().err
    header = next(line for line in err.splitlines() if "prefill chunk" in line)
    assert header.endswith("think none (plain text)"), header
    assert "--think-max has no effect: the prompt is continued as plain text (the model has no chat template)" in err
    assert "add --chat" in err
    # rendered as a chat turn, Think Max below its context falls back to normal thinking, and says so
    assert cli.main(["run", "-p", "ROMEO:", "--chat", "--think-max", "-n", "1", "--temp", "0", "--ctx", "64",
                     *FAST]) == 0
    err = capsys.readouterr().err
    assert "ctx=64 uses normal thinking" in err and ", think high" in err


def test_stats_explains_the_transcript_and_kv_difference():
    proc = ds4lab_cmd("run", "--nothink", "--temp", 0, "-n", 4, "--ctx", 256, *FAST,
                      input="/stats\nHello\n/stats\n/quit\n")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    stats = [i for i, line in enumerate(lines) if "> session: " in line]
    assert len(stats) == 2
    # before the first turn: the chat's start is in the transcript only
    numbers = re.compile(r"session: (\d+)/\d+ .*transcript (\d+) tokens")
    held, transcript = (int(x) for x in numbers.search(lines[stats[0]]).groups())
    assert held == 0 and transcript > 0
    assert f"the transcript's {transcript} tokens (the start of the chat" in lines[stats[0] + 1]
    # after it: the EOS that ds4 appends to the transcript is not in the KV cache yet
    held, transcript = (int(x) for x in numbers.search(lines[stats[1]]).groups())
    assert transcript == held + 1
    assert "the transcript is 1 token longer: it ends with the end-of-sequence token" in lines[stats[1] + 1]


def test_generation_view_title_does_not_repeat_the_count(model):
    pytest.importorskip("anywidget")
    from ds4lab.viz import GenerationView

    sess = model.session(ctx=128, prefill_chunk=32)
    view = GenerationView(sess, "ROMEO:", max_tokens=3, seed=1)
    titles = []
    sess.step_observers.append(lambda record: titles.append(re.search(r"<b>(.*?)</b>", view.static_html()).group(1)))
    view.run(3)
    # while a run goes the title counts the tokens and says it is running (an observer sees the step before the
    # view records it: the title shows the tokens before it)
    assert titles[-3:] == [f"Generation: {n} tokens — running" for n in (0, 1, 2)], titles
    view.step()
    title = re.search(r"<b>(.*?)</b>", view.static_html()).group(1)
    assert title == "Generation: 4 tokens — paused: run or step for more", title
    assert repr(view) == "GenerationView(4 tokens generated, paused: run or step for more)"
    view.run(2)
    title = re.search(r"<b>(.*?)</b>", view.static_html()).group(1)
    assert title == "Generation: 6 tokens — paused: run or step for more"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


# -- issue 22's command-line cases --------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [["run", "-m", "", "-p", "x"], ["inspect", ""], ["make-model", "-o", ""]])
def test_an_empty_path_is_refused_by_name(argv, capsys):
    """``Path("")`` is the current folder: ``-m ''`` once reported ``. : not a regular file``."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2 and "an empty path" in capsys.readouterr().err


def test_bench_ctx_max_past_the_model_context_is_refused_first():
    """--ctx-max 2^40 once listed 536M frontiers before failing with MemoryError."""
    proc = ds4lab_cmd("bench", "--backend", "numpy", "--ctx-max", 1 << 40, timeout=60)
    line = one_error_line(proc, 2)
    assert "--ctx-max 1099511627776" in line and "context" in line
    assert proc.stdout == "" and "prefill" not in proc.stderr
    # --ctx-alloc the same way (it allocated the session's KV for a billion tokens: a MemoryError of 238 GiB)
    proc = ds4lab_cmd("bench", "--backend", "numpy", "--ctx-max", 64, "--ctx-alloc", 10**9, timeout=60)
    line = one_error_line(proc, 2)
    assert "--ctx-alloc 1000000000 is more than 4096: the model's context (4096 tokens" in line


def test_a_sweep_of_too_many_frontiers_is_refused():
    from ds4lab import bench

    with pytest.raises(bench.BenchError, match="more than 100,000 frontiers"):
        bench.frontiers(1, 1 << 40, 1)


# -- the fresh-clone walk-through ----------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]


def _extras() -> dict[str, set[str]]:
    import tomllib

    def name(requirement: str) -> str:
        return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {extra: {name(r) for r in reqs} for extra, reqs in
            {"": project["dependencies"], **project["optional-dependencies"]}.items()}


def _third_party_imports(path: Path) -> set[str]:
    """The top-level modules ``path`` imports (``import``, ``from``, ``pytest.importorskip``) that are neither the
    standard library's nor this repository's."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip"
              and node.args and isinstance(node.args[0], ast.Constant)):
            found.add(node.args[0].value.split(".")[0])
    return {m for m in found if m not in sys.stdlib_module_names and m not in ("ds4lab", "tests", "__future__")}


@pytest.mark.parametrize("script", ["tests/test_server.py", "benchmarks/server_load.py"])
def test_the_test_extra_installs_what_the_server_tests_import(script):
    """openai and anthropic no longer bring httpx (they depend on httpx2): without it in the extra a fresh
    ``pip install -e ".[test]"`` skipped every server test and server_load.py did not start."""
    extras = _extras()
    modules = _third_party_imports(ROOT / script)
    assert "httpx" in modules
    missing = {m.replace("_", "-") for m in modules} - extras["test"] - extras[""]
    assert not missing, f"{script} imports {sorted(missing)}, which the test extra does not install"


def test_the_lite_extra_installs_jupyter_server():
    """``jupyter lite build --contents`` (lite/build.py) refuses to run without jupyter-server."""
    assert "jupyter-server" in _extras()["lite"]


def test_lite_build_reports_a_failing_command_in_one_line(capsys):
    import importlib.util

    pytest.importorskip("nbformat")
    spec = importlib.util.spec_from_file_location("lite_build", ROOT / "lite" / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    with pytest.raises(SystemExit) as e:
        build.run(sys.executable, "-c", "import sys; sys.exit(3)")
    message = str(e.value.code)
    assert "\n" not in message and "failed with exit code 3" in message and "-c" in message, message
    with pytest.raises(SystemExit) as e:
        build.run(str(ROOT / "no-such-program"))
    assert "could not start" in str(e.value.code)


@pytest.mark.parametrize("ctx", [4097, 100000, 100000000])
def test_run_refuses_a_ctx_above_the_model_context_like_serve(ctx):
    """``-c 100000`` once ran with a context past the model's 4096, ``-c 100000000`` ended in MemoryError."""
    proc = ds4lab_cmd("run", "-p", "ROMEO:", "-c", ctx, "-n", 1, *FAST)
    assert f"--ctx must be in [3, 4096] for this model, got {ctx}" in one_error_line(proc, 2)
    no_work_started(proc)


def test_run_accepts_the_model_context_itself():
    proc = ds4lab_cmd("run", "-p", "ROMEO:", "-c", 4096, "-n", 1, "--temp", 0, *FAST)
    assert proc.returncode == 0, proc.stderr
    assert "ctx 4096" in proc.stderr


def test_chat_ctx_command_is_capped_at_the_model_context():
    proc = ds4lab_cmd("run", "--nothink", "--ctx", 64, *FAST, input="/ctx 100000\n/stats\n/quit\n")
    assert proc.returncode == 0, proc.stderr
    assert "/ctx must be in [3, 4096] for this model, got 100000" in proc.stderr
    assert "session: 0/64 tokens" in proc.stdout  # the session was kept


def test_a_prompt_longer_than_the_model_context_asks_for_a_shorter_one(model, tmp_path):
    text = tmp_path / "long.txt"
    text.write_text("ROMEO: " + "word " * 5000)
    n = len(model.tokenizer.encode(text.read_text()))
    assert n > 4096
    line = one_error_line(ds4lab_cmd("run", "--prompt-file", text, *FAST), 1)
    assert f"the prompt has {n} tokens and the context holds 4096" in line
    assert f"--ctx {n + 2}" not in line  # no context this model takes would hold it
    assert "the model's context is at most 4096 tokens: shorten the prompt to at most 4094 tokens" in line
    line = one_error_line(ds4lab_cmd("run", "--prompt-file", text, "--ctx", 100, *FAST), 1)
    assert "use --ctx 4096 and shorten the prompt to at most 4094 tokens" in line


def test_no_room_suggests_a_context_only_where_the_model_has_one():
    from ds4lab.cli.generate import no_room

    assert "use --ctx 102 or more" in no_room(100, 50, most=4096)
    # the arithmetic as it stands (it said "ctx - prompt - 1 = 0" for a prompt twice the context)
    assert "at most ctx - prompt - 1 tokens: 50 - 100 - 1 = -51, none)" in no_room(100, 50, most=4096)
    assert "use --ctx 4096 or more" in no_room(4094, 4000, most=4096)  # the largest prompt that fits
    assert "shorten the prompt to at most 4094 tokens" in no_room(4095, 4096, most=4096)
    assert "use /ctx 4096 and shorten this turn to at most 4094 tokens" in no_room(5000, 64, "this turn", "/ctx",
                                                                                  most=4096)


@pytest.mark.parametrize("port", ["99999", "65536", "-1", "http"])
def test_serve_port_out_of_range_is_refused_while_parsing(port, capsys):
    """``--port 99999`` once loaded the model, then failed with OverflowError."""
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--port", port])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--port: expected a port number in [0, 65535], got '{port}'" in err and len(err.splitlines()) == 1


def test_serve_port_in_use_names_the_address(tmp_path):
    """Before the model loads (it was said after loading it: minutes for the Flash file), and the --kv-disk-dir
    made for it is taken away again."""
    import socket

    pytest.importorskip("uvicorn")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = ds4lab_cmd("serve", "--backend", "numpy", "--port", port, "--kv-disk-dir", tmp_path / "new" / "kv",
                          timeout=120)
    line = one_error_line(proc, 1)
    assert f"cannot listen on --host 127.0.0.1 --port {port}: Address already in use" in line, line
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr  # no model described: none was loaded
    assert not (tmp_path / "new").exists()


def test_bench_errors_name_the_flags():
    line = one_error_line(ds4lab_cmd("bench", "--ctx-start", 4096, "--ctx-max", 256, *FAST), 2)
    assert "--ctx-start 4096 must be <= --ctx-max 256" in line
    line = one_error_line(ds4lab_cmd("bench", "--ctx-start", 64, "--ctx-max", 256, "--ctx-alloc", 100, *FAST), 2)
    assert "--ctx-alloc 100 must be greater than --ctx-max + --gen-tokens = 256 + 128 = 384" in line
    line = one_error_line(ds4lab_cmd("bench", "--ctx-start", 8192, *FAST), 2)
    assert "--ctx-start 8192 must be <= --ctx-max, which is 4096 here by default" in line


def test_bench_library_errors_name_the_arguments():
    from ds4lab import bench

    with pytest.raises(bench.BenchError, match=r"^ctx_start=4096 must be <= ctx_max=256$"):
        bench.check_sweep(4096, 256, 2048, 1.0, 128)
    with pytest.raises(bench.BenchError, match=r"^ctx_alloc=100 must be greater than ctx_max \+ gen_tokens = "):
        bench.check_sweep(64, 256, 2048, 1.0, 128, ctx_alloc=100)
    with pytest.raises(bench.BenchError, match=r"^--step-mul must be >= 1, got 0.5$"):
        bench.check_sweep(64, 256, 2048, 0.5, 128, flags=True)


def test_run_prompt_file_errors_name_the_flag(tmp_path):
    for path, problem in ((tmp_path / "nope.txt", "no such file"), (tmp_path, "is a directory")):
        for extra in ([], ["--graph-test"]):
            proc = ds4lab_cmd("run", "--prompt-file", path, *extra, *FAST)
            line = one_error_line(proc, 1)
            assert f"--prompt-file {path}: {problem}" in line, line
            no_work_started(proc)


@pytest.mark.parametrize("flags, named", [
    (["--prefill-matmul", "f16"], "--prefill-matmul f16 needs --backend cupy (got --backend numpy)"),
    (["--decode-matmul", "q8"], "--decode-matmul q8 needs --backend cupy (got --backend numpy)"),
])
def test_cupy_only_matmul_flags_are_usage_errors(flags, named):
    proc = ds4lab_cmd("run", "-p", "x", *flags, *FAST)
    line = one_error_line(proc, 2)
    assert named in line and "prefill_matmul=" not in line and "decode_matmul=" not in line, line
    no_work_started(proc)


def test_cupy_only_matmul_flags_need_the_kernels():
    """Checked before CuPy is imported: the flags conflict whatever the machine has."""
    proc = ds4lab_cmd("run", "-p", "x", "--backend", "cupy", "--no-kernels", "--decode-matmul", "q8")
    assert "--decode-matmul q8 needs the cupy backend's kernels: drop --no-kernels" in one_error_line(proc, 2)


def test_inspect_and_make_model_help_explain_their_arguments(capsys):
    with pytest.raises(SystemExit):
        cli.main(["inspect", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "positional arguments: FILE the GGUF model file (.gguf) or KV cache file (.kv)" in text, text
    with pytest.raises(SystemExit):
        cli.main(["make-model", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--seed N seed of the random weights (default 0)" in text, text


# -- a bad-input probe of the command line (2026-12-06) ------------------------------------------------------------

SWEEP = [*FAST, "--ctx-start", 32, "--ctx-max", 64, "-n", 2]


def test_bench_output_that_names_the_default_prompt_is_refused():
    from ds4lab.bench import default_prompt_path

    prompt = default_prompt_path()
    if prompt is None:
        pytest.skip("no data/promessi_sposi.txt beside this ds4lab")
    before = prompt.stat().st_size
    line = one_error_line(ds4lab_cmd("bench", "--csv", prompt, *SWEEP), 2)
    assert f"is the file of --prompt-file {prompt}" in line and prompt.stat().st_size == before


@pytest.mark.parametrize("case", ["model", "prompt-file", "plot-is-csv"])
def test_bench_output_that_names_an_input_is_refused_first(case, tmp_path):
    """``--csv`` naming the file of ``-m`` overwrote the model with a CSV header (then blamed the file for changing),
    and naming ``--prompt-file`` replaced the text with the CSV, exit 0."""
    model, text = tmp_path / "victim.gguf", tmp_path / "prompt.txt"
    model.write_bytes((Path(ds4lab.__file__).parent / "assets" / "shakespeare.gguf").read_bytes())
    text.write_text("ROMEO: " * 200)
    before = {p: p.read_bytes() for p in (model, text)}
    argv = {"model": ["-m", model, "--csv", model],
            "prompt-file": ["--prompt-file", text, "--csv", tmp_path / "." / "prompt.txt"],
            "plot-is-csv": ["--csv", tmp_path / "out.html", "--plot", tmp_path / "out.html"]}[case]
    proc = ds4lab_cmd("bench", *argv, *SWEEP)
    line = one_error_line(proc, 2)
    flag, other = {"model": ("--csv", "-m"), "prompt-file": ("--csv", "--prompt-file"),
                   "plot-is-csv": ("--plot", "--csv")}[case]
    assert f"{flag} " in line and f"is the file of {other} " in line
    assert proc.stdout == "" and "prefill" not in proc.stderr  # before any work
    assert all(p.read_bytes() == data for p, data in before.items())
    assert not (tmp_path / "out.html").exists()


def test_bench_plot_suffix_in_any_case(tmp_path):
    """``--plot x.Html`` passed the check, ran the sweep, then failed in Altair: 'Unsupported format: Html'."""
    target = tmp_path / "x.Html"
    proc = ds4lab_cmd("bench", *SWEEP, "--plot", target)
    assert proc.returncode == 0, proc.stderr
    assert target.read_text().lstrip().lower().startswith("<!doctype html")


def test_bench_gen_tokens_past_the_context_is_refused_first():
    """-n 99999999 grew the default allocation with it: MemoryError for 23.8 GiB after loading the model."""
    proc = ds4lab_cmd("bench", *FAST, "-n", 99999999)
    line = one_error_line(proc, 2)
    assert "-n/--gen-tokens 99999999 is more than the model's context (4096 tokens" in line
    assert proc.stdout == "" and "prefill" not in proc.stderr  # before any work


def test_a_prompt_that_is_not_utf8_is_read_as_a_file_is():
    """A -p holding a byte that is not UTF-8 ended in "'utf-8' codec can't encode character '\\udce9'"."""
    proc = ds4lab_cmd("run", *FAST, "-p", "caf\udce9", "-n", 2)  # the argument's bytes: b"caf\xe9"
    assert proc.returncode == 0 and "codec" not in proc.stderr, proc.stderr
    assert cli_common.decoded("caf\udce9") == "caf\ufffd" and cli_common.decoded("café") == "café"


def test_chat_commands_with_a_word_after_them_say_so():
    """'/quit now' was an 'unknown command: /quit'."""
    proc = ds4lab_cmd("run", *FAST, "-n", 2, input="/quit now\n/stats please\n/quit\n")
    assert proc.returncode == 0, proc.stderr
    assert "/quit takes no argument, got 'now'" in proc.stderr and "/stats takes no argument" in proc.stderr
    assert "unknown command" not in proc.stderr


@pytest.mark.parametrize("host", ["", "  "])
def test_serve_refuses_an_empty_host(host, capsys):
    """``--host ""`` listened on every interface and announced http://:PORT/v1."""
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--host", host])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--host: an empty address" in err and len(err.splitlines()) == 1


def test_serve_leaves_no_kv_folder_when_the_model_fails(tmp_path):
    """``--kv-disk-dir new/a/b`` made the folders, then the model failed to load and they stayed."""
    pytest.importorskip("starlette")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"x")
    (tmp_path / "kept").mkdir()
    for folder, model in ((tmp_path / "new" / "a" / "b", tmp_path / "missing.gguf"),
                          (tmp_path / "new" / "a" / "b", bad), (tmp_path / "kept" / "a", bad),
                          (tmp_path / "new" / ".." / "kept", bad)):  # kept, not new/kept: the folder was there
        proc = ds4lab_cmd("serve", "--backend", "numpy", "--kv-disk-dir", folder, "-m", model)
        assert str(model) in one_error_line(proc, 1)
        assert not (tmp_path / "new").exists() and not (tmp_path / "kept" / "a").exists()
        assert (tmp_path / "kept").is_dir()
    proc = ds4lab_cmd("serve", "--backend", "numpy", "--kv-disk-dir", tmp_path / "new", "--ctx", 99999999)
    assert "--ctx" in one_error_line(proc, 2) and not (tmp_path / "new").exists()  # a refused setting too


def test_system_prompt_on_plain_text_says_it_has_no_effect(tmp_path):
    """-sys was dropped without a word where the prompt is continued as plain text (--think said so)."""
    proc = ds4lab_cmd("run", *FAST, "-sys", "Be brief.", "-p", "ROMEO:", "-n", 2)
    assert proc.returncode == 0 and "warning: -sys has no effect" in proc.stderr, proc.stderr
    assert "-sys" not in ds4lab_cmd("run", *FAST, "-p", "ROMEO:", "-n", 2).stderr  # the default: no warning
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert f"--prompt-file {empty}: the prompt is empty" in one_error_line(
        ds4lab_cmd("run", *FAST, "--prompt-file", empty), 1)


def test_bench_sweep_takes_whole_numbers_given_as_floats(model):
    """ctx_max=64.0 passed check_sweep, then the session said "ctx must be an integer, got 67.0", naming a ctx
    the caller never gave; a ctx_alloc of 100.5 was not checked at all."""
    from ds4lab import bench

    assert bench.check_sweep(32.0, 64.0, 32.0, 1.0, 2.0) == 67 and type(bench.check_sweep(32, 64, 32, 1.0, 2)) is int
    with pytest.raises(bench.BenchError, match=r"^ctx_alloc must be a positive integer, got 100.5$"):
        bench.check_sweep(32, 64, 32, 1.0, 2, ctx_alloc=100.5)
    tokens, _ = bench.prompt_tokens(model, min_tokens=64)
    rows = list(bench.sweep(model, tokens, 32.0, 64.0, 32.0, 1.0, 2.0, prefill_chunk=32, warmup=0))
    assert [r.ctx_tokens for r in rows] == [32, 64] and all(type(r.ctx_tokens) is int for r in rows)


@pytest.mark.parametrize("flag", ["--think", "--think-max"])
def test_serve_says_when_a_think_flag_does_nothing(flag, capsys, monkeypatch):
    """On a model without a chat template no request thinks: ``serve --think`` said "think none" and nothing more
    (``run --think`` warns); the flag is named now. The server is not started: serve() is replaced."""
    pytest.importorskip("starlette")
    import ds4lab.server as server

    monkeypatch.setattr(server, "serve", lambda worker, app, *a, sock, **k: sock.close())
    assert cli.main(["serve", "--backend", "numpy", "--port", "0", flag]) == 0
    err = capsys.readouterr().err
    assert f"warning: {flag} has no effect: the model has no chat template, so no request thinks" in err, err
    assert cli.main(["serve", "--backend", "numpy", "--port", "0"]) == 0  # the default: no flag, no warning
    assert "warning" not in capsys.readouterr().err
    # a chat model: Think Max below its context falls back to normal thinking, and the header says the mode used
    monkeypatch.setattr(ds4lab.Model, "is_chat", property(lambda self: True))
    assert cli.main(["serve", "--backend", "numpy", "--port", "0", "--ctx", "4096", flag]) == 0
    err = capsys.readouterr().err
    assert ", think high," in err and ("ctx=4096 uses normal thinking" in err) == (flag == "--think-max"), err


def test_serve_cors_flag_reaches_the_app(monkeypatch):
    """``serve --cors`` gives the app ds4-server's CORS headers (tests/test_server.py checks what they do); without
    it the app has none. The server is not started: serve() is replaced."""
    pytest.importorskip("starlette")
    import ds4lab.server as server

    apps = []
    monkeypatch.setattr(server, "serve", lambda worker, app, *a, sock, **k: (apps.append(app), sock.close()))
    assert cli.main(["serve", "--backend", "numpy", "--port", "0", "--cors"]) == 0
    assert cli.main(["serve", "--backend", "numpy", "--port", "0"]) == 0
    [cors] = [m.kwargs["cors"] for m in apps[0].user_middleware]
    [plain] = [m.kwargs["cors"] for m in apps[1].user_middleware]
    assert cors is True and plain is False


def test_output_errors_say_why(tmp_path, monkeypatch):
    """A read-only file system was reported as "permission denied"; a write that ran out of disk said only numpy's
    "N requested and M written". Both causes are simulated here (no mount in a test)."""
    import os
    import shutil

    from ds4lab import gguf_file
    from ds4lab.cli.common import check_output

    monkeypatch.setattr(os, "access", lambda *a, **k: False)
    monkeypatch.setattr(os, "statvfs", lambda p: SimpleNamespace(f_flag=os.ST_RDONLY))
    with pytest.raises(OSError, match=r"-o .*x\.gguf: cannot create a file in .* \(a read-only file system\)"):
        check_output(tmp_path / "x.gguf", "-o")
    monkeypatch.setattr(os, "statvfs", lambda p: SimpleNamespace(f_flag=0))
    with pytest.raises(OSError, match=r"\(permission denied\)"):
        check_output(tmp_path / "x.gguf", "-o")
    monkeypatch.delattr(os, "statvfs")  # Windows has none
    with pytest.raises(OSError, match=r"\(permission denied\)"):
        check_output(tmp_path / "x.gguf", "-o")
    monkeypatch.undo()

    def cut(*a):
        raise OSError("34816 requested and 1536 written")

    def usage(folder):  # a full disk while the partial file is there: its unlink gives the space back
        return SimpleNamespace(free=0 if any(p.name.endswith(".tmp") for p in tmp_path.iterdir()) else 1 << 30)

    monkeypatch.setattr(gguf_file, "_write_tensor_data", cut)
    monkeypatch.setattr(shutil, "disk_usage", usage)
    with pytest.raises(OSError, match=r"writing .*x\.gguf: 34816 requested and 1536 written \(no space left on the "
                                      r"device: 0 bytes free\)"):
        gguf_file.write_gguf(tmp_path / "x.gguf", {"general.architecture": ("deepseek4", "STRING")}, [])
    assert list(tmp_path.iterdir()) == []


def test_warnings_are_one_line_like_the_rest(monkeypatch, capsys):
    """A KV store's failed save under serve printed Python's format: the library's file and line, the category and
    a line of its source. The command prints it as its other lines."""
    import warnings

    from ds4lab.cli import run as run_cli

    real = run_cli.load_model

    def warning_load(args):
        warnings.warn("a KV file could not be saved: No space left on device", ds4lab.KVStoreWarning, stacklevel=2)
        return real(args)

    monkeypatch.setattr(run_cli, "load_model", warning_load)
    assert cli.main(["run", "--backend", "numpy", "-p", "ROMEO:", "-n", "1"]) == 0
    err = capsys.readouterr().err
    assert "ds4lab: warning: a KV file could not be saved: No space left on device\n" in err, err
    assert "KVStoreWarning" not in err and ".py:" not in err


def test_version_is_printed(capsys):
    """``ds4lab --version``: the package's version (it was refused as an unknown option)."""
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"ds4lab {ds4lab.__version__}\n"
