"""A clone stands alone: no file of the repository points at a ``shared`` folder beside the checkout or at a
path of the machine it was written on, and no code climbs from its own location above the repository.

The files checked are git's (tracked, plus untracked ones not ignored) when the repository is a git work
tree, else every file under the repository's root that ``.gitignore`` does not exclude (``.ci/run`` tests a
copy of the tracked files, without ``.git``). The data the project reads lives in its own ``data/``.
"""

from __future__ import annotations

import fnmatch
import re
import subprocess
from pathlib import Path

import pytest

from ds4lab.testing import data_dir, data_file

ROOT = Path(__file__).resolve().parent.parent
SELF = Path(__file__).resolve().relative_to(ROOT).as_posix()
BINARY_SUFFIXES = {".gguf", ".png", ".jpg", ".jpeg", ".gif", ".whl", ".gz", ".zip", ".kv", ".so", ".pyc"}

# A path into a "shared" folder beside the checkout, or an absolute path of the machine this was written on.
OUTSIDE = [
    (re.compile(r"\.\./shared\b"), "a ../shared path"),
    (re.compile(r"(?<![\w./-])/work/"), "an absolute /work/ path"),
    (re.compile(r"""["']shared["']\s*/|/\s*["']shared["']"""), "a path joined with a 'shared' folder"),
    (re.compile(r"(?<![\w-])shared/(?:data|spec|device|seeds|hooks|DESIGN\.md)\b"), "a shared/... path"),
]
# Path(__file__)[.resolve()] followed by .parent / .parents[k] steps: how far above the file it climbs.
FILE_CLIMB = re.compile(r"Path\(__file__\)(?:\.resolve\(\)|\.absolute\(\))?((?:\.parent\b|\.parents\[\d+\])+)")
STEP = re.compile(r"\.parent\b|\.parents\[(\d+)\]")


def repo_files() -> list[str]:
    """Repository-relative paths of the files a clone has (see the module docstring)."""
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
        if top.returncode == 0 and Path(top.stdout.strip()).resolve() == ROOT:
            out = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT,
                                 capture_output=True, timeout=60, check=True).stdout
            return sorted({p for p in out.decode().split("\0") if p and (ROOT / p).is_file()})
    except (OSError, subprocess.SubprocessError):
        pass
    return sorted(_walk_unignored())


def _walk_unignored() -> list[str]:
    patterns = [".git/"]
    gitignore = ROOT / ".gitignore"
    if gitignore.is_file():
        patterns += [line.strip() for line in gitignore.read_text().splitlines()
                     if line.strip() and not line.startswith("#")]

    def ignored(rel: str, is_dir: bool) -> bool:
        name = rel.rsplit("/", 1)[-1]
        for pat in patterns:
            if pat.endswith("/") and not is_dir:
                continue
            pat = pat.rstrip("/")
            if pat.startswith("/") or "/" in pat:
                if fnmatch.fnmatch(rel, pat.lstrip("/")):
                    return True
            elif fnmatch.fnmatch(name, pat):
                return True
        return False

    out, stack = [], [ROOT]
    while stack:
        folder = stack.pop()
        for p in folder.iterdir():
            rel = p.relative_to(ROOT).as_posix()
            if p.is_symlink():
                continue
            if p.is_dir():
                if not ignored(rel, True):
                    stack.append(p)
            elif not ignored(rel, False):
                out.append(rel)
    return out


def offences(rel: str, text: str) -> list[str]:
    """What in file ``rel`` (repository-relative) with contents ``text`` reaches outside the repository."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for pattern, what in OUTSIDE:
            if pattern.search(line):
                found.append(f"{rel}:{n}: {what}: {line.strip()[:160]}")
        if rel.endswith(".py"):
            for m in FILE_CLIMB.finditer(line):
                levels = sum(int(s.group(1)) + 1 if s.group(1) else 1 for s in STEP.finditer(m.group(1)))
                if levels > rel.count("/") + 1:  # the file's folder is 1 level up, the root rel.count("/") + 1
                    found.append(f"{rel}:{n}: Path(__file__) climbs {levels} levels, above the repository: "
                                 f"{line.strip()[:160]}")
    return found


def _text(rel: str) -> str | None:
    path = ROOT / rel
    if path.suffix.lower() in BINARY_SUFFIXES:
        return None
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    return data.decode("utf-8", errors="replace")


def test_no_file_reaches_outside_the_repository():
    files = repo_files()
    assert "README.md" in files and "pyproject.toml" in files, files[:20]
    found = []
    for rel in files:
        text = None if rel == SELF else _text(rel)
        if text is not None:
            found += offences(rel, text)
    assert not found, "files that point outside the repository:\n" + "\n".join(found)


@pytest.mark.parametrize("rel, text, n", [
    ("tests/test_x.py", 'DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "t.txt"', 2),
    ("tests/test_x.py", 'DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"', 2),
    ("tests/test_x.py", 'ROOT = Path(__file__).resolve().parents[1]', 0),
    ("ds4lab/model/x.py", 'ROOT = Path(__file__).resolve().parent.parent.parent', 0),
    ("ds4lab/model/x.py", 'ROOT = Path(__file__).parents[3]', 1),
    ("benchmarks/x.py", 'TEXTS = [ROOT / "shared/data/t.txt", Path("/work/shared/data/t.txt")]', 2),
    ("README.md", "(staging as `../shared/device/README.md` describes)", 2),
    ("README.md", "see https://example.org/work/notes and data/tinyshakespeare.txt", 0),
    ("docs/x.md", "shared memory, a shared expert, group-shared floats", 0),
])
def test_the_check_catches_what_it_should(rel, text, n):
    assert len(offences(rel, text)) == n, offences(rel, text)


def test_the_data_the_project_reads_is_in_the_repository():
    assert data_dir() == ROOT / "data"
    for name in ("tinyshakespeare.txt", "promessi_sposi.txt", "README.md"):
        path = data_file(name)
        assert path.is_relative_to(ROOT) and path.stat().st_size > 0
    with pytest.raises(FileNotFoundError, match="no-such-file"):
        data_file("no-such-file.txt")
