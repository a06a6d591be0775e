"""The README's Python snippets run as written, in order, on the embedded model (CPU): each block continues
the names of the blocks before it, as a reader pasting them into one notebook would. The GPU block is the one
left out (it needs CuPy or MLX's GPU), and so named below."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_snippets_run_in_order():
    pytest.importorskip("anywidget")
    blocks = _blocks()
    gpu = [b for b in blocks if 'backend="cupy"' in b]
    assert len(blocks) >= 4 and len(gpu) == 1, "the README's snippets changed: update this test's GPU rule"
    ns: dict = {}
    for block in blocks:
        if block in gpu:
            continue
        exec(compile(block, f"README.md block {blocks.index(block)}", "exec"), ns)  # noqa: S102
    sess = ns["sess"]
    # what the snippets say happened: the view ran the 300-token prompt, the capture the chunk after it
    assert len(sess.tokens) == 320 and sess.tokens == ns["prompt_ids"][:320]
    assert ns["cap"].records("blk.2.attn.scores")


# -- the command-line transcripts --------------------------------------------------------------------------------
# Every ``$ `` command in a ```text block runs as written (on the numpy backend where "auto" would choose another)
# and its output, stdout and stderr together as a terminal shows them, is compared with the README's: a line
# "..." stands for any number of lines, and timings are left out of the comparison (t/s, the bench's rates, peak
# RSS and sweep time: they are one run's).

ROOT = README.parent
CHECKOUT = "/path/to/ds4lab"  # how the README writes the checkout's absolute path (the bench names its prompt by it)
_RATE = re.compile(r"\d+(?:\.\d+)? t/s")
# a bench CSV row: its rates and the process's peak RSS are one run's, its tokens and KV bytes are checked
_BENCH_ROW = re.compile(r"^(\d+),(\d+),[\d.]+,(\d+),[\d.]+,(\d+),\d+$")
_SWEEP_TIME = re.compile(r"frontiers in [\d.]+ s")


def _transcripts() -> list[tuple[str, list[str]]]:
    """(command, expected output lines) for every ``$ `` line of the README's ```text blocks."""
    found = []
    for block in re.findall(r"```text\n(.*?)```", README.read_text(), flags=re.S):
        for part in re.split(r"^\$ ", block, flags=re.M)[1:]:
            command, *output = part.rstrip("\n").split("\n")
            while output and not output[-1].strip():
                output.pop()
            found.append((command, output))
    return found


def _normalized(lines: list[str]) -> list[str]:
    """The lines with one run's timings (and peak RSS) left out."""
    lines = [_RATE.sub("N t/s", line.rstrip()) for line in lines]
    return [_SWEEP_TIME.sub("frontiers in N s", _BENCH_ROW.sub(r"\1,\2,N,\3,N,\4,N", line)) for line in lines]


def _matches(expected: list[str], actual: list[str]) -> bool:
    """``expected`` against the whole of ``actual``, an "..." line matching any run of lines (none included)."""
    import functools

    @functools.lru_cache(maxsize=None)
    def match(i: int, j: int) -> bool:
        if i == len(expected):
            return j == len(actual)
        if expected[i].strip() == "...":
            return any(match(i + 1, k) for k in range(j, len(actual) + 1))
        return j < len(actual) and expected[i] == actual[j] and match(i + 1, j + 1)

    return match(0, 0)


def _run_transcript(command: str, tmp_path: Path) -> tuple[str, dict[str, str]]:
    """Runs ``command`` (``ds4lab ...``, or ``printf '...' | ds4lab ...``) from the repository root; returns its
    output and the README's paths replaced by the ones used (``-o`` goes to ``tmp_path``)."""
    import os
    import shlex
    import subprocess
    import sys

    from ds4lab.backends import resolve_backend

    stdin = None
    if " | " in command:
        feed, command = command.split(" | ", 1)
        printf, fmt = shlex.split(feed)
        assert printf == "printf", feed
        stdin = fmt.encode().decode("unicode_escape")
    argv = shlex.split(command)
    assert argv[0] == "ds4lab", command
    replaced = {CHECKOUT: str(ROOT)}
    if "-o" in argv:
        i = argv.index("-o") + 1
        replaced[argv[i]] = str(tmp_path / Path(argv[i]).name)
        argv[i] = replaced[argv[i]]
    if argv[1] in ("run", "bench") and resolve_backend("auto") != "numpy":
        argv += ["--backend", "numpy"]  # the transcripts are of the numpy backend ("auto" on a CPU)
    env = {k: v for k, v in os.environ.items() if k not in ("DS4LAB_TRACEBACK", "DS4_METAL_PREFILL_CHUNK")}
    env["PYTHONIOENCODING"] = "utf-8"
    proc = subprocess.run([sys.executable, "-m", "ds4lab.cli", *argv[1:]], input=stdin, cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, encoding="utf-8",
                          timeout=600, check=False)
    assert proc.returncode == 0, (command, proc.stdout)
    return proc.stdout, replaced


def test_the_transcripts_are_found():
    commands = [command for command, _ in _transcripts()]
    assert all(any(c.startswith(f"ds4lab {name}") for c in commands) for name in ("inspect", "run", "bench"))


@pytest.mark.parametrize("command, expected", _transcripts(), ids=[t[0][:60] for t in _transcripts()])
def test_the_readme_transcripts_are_real_output(command, expected, tmp_path):
    output, replaced = _run_transcript(command, tmp_path)
    for old, new in replaced.items():
        expected = [line.replace(old, new) for line in expected]
    actual = output.rstrip().split("\n")
    if actual and actual[-1].strip() == "ds4lab>":  # the chat's last prompt, where /quit was read
        actual.pop()
    for line in actual:  # what the bench's rows leave out of the comparison is still checked to be a measurement
        if _BENCH_ROW.match(line):
            _, _, prefill_tps, _, gen_tps, _, rss = line.split(",")
            assert float(prefill_tps) > 0 and float(gen_tps) > 0 and int(rss) > 10 * 2**20, line
    expected, actual = _normalized(expected), _normalized(actual)
    if not _matches(expected, actual):
        missing = [line for line in expected if line.strip() != "..." and line not in actual]
        if missing:
            detail = "README.md's lines not in the output:\n" + "\n".join(missing[:10])
        else:
            import difflib

            detail = "\n".join(list(difflib.unified_diff(expected, actual, "README.md", "output", lineterm=""))[:60])
        pytest.fail(f"README.md's transcript of `{command}` is not its output ({len(actual)} lines):\n{detail}\n"
                    f"the output begins:\n" + "\n".join(actual[:8]))


# -- the Command line section's claims about the parser ------------------------------------------------------------

def _prose() -> str:
    return " ".join(re.sub(r"```.*?```", "", README.read_text(), flags=re.S).split())


def _commands() -> dict:
    import argparse

    from ds4lab.cli import build_parser

    return next(a.choices for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))


def test_the_readme_names_every_subcommand():
    commands = _commands()
    said = re.search(r"has (\w+) subcommands: (.*?);", _prose())
    assert said, "README.md no longer says how many subcommands ds4lab has"
    words = {3: "three", 4: "four", 5: "five", 6: "six", 7: "seven"}
    assert said.group(1) == words[len(commands)], said.group(0)
    assert set(re.findall(r"`([\w-]+)`", said.group(2))) == set(commands), said.group(0)


def test_the_model_flag_table_names_the_commands_that_take_it():
    said = re.search(r"((?:`[\w-]+`(?:, | and )?)+) load a model with the same flags", _prose())
    assert said, "README.md's sentence before the model flags' table changed"
    takers = {name for name, sub in _commands().items() if "--prefill-matmul" in sub._option_string_actions}
    assert set(re.findall(r"`([\w-]+)`", said.group(1))) == takers, said.group(0)


def test_the_readme_exit_codes_say_what_an_interrupt_does():
    import ds4lab.cli

    prose = _prose()
    assert "130 when interrupted outside generation" in prose
    assert "130 when interrupted outside generation" in " ".join(ds4lab.cli.__doc__.split())
    assert "`run` prints the summary (the stop reason `interrupted`) and exits 0" in prose
