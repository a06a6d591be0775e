"""A clone stands alone: no file of the repository points at a ``shared`` folder beside the checkout or at a
path of the machine it was written on, no code climbs from its own location above the repository, and no
comment, docstring or document cites a document the repository does not hold: the repository's own documents
are cited by file and heading (``docs/MODEL.md, "Attention"``), and each such heading must exist.

The files checked are git's (tracked, plus untracked ones not ignored) when the repository is a git work
tree, else every file under the repository's root that ``.gitignore`` does not exclude (``.ci/run`` tests a
copy of the tracked files, without ``.git``); in both, not a virtual environment's (a folder holding
``pyvenv.cfg``, made in the clone under any name). The data the project reads lives in its own ``data/``.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import posixpath
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

# Citations are checked in these files (code, documents, notebooks).
CITING_SUFFIXES = (".py", ".md", ".ipynb", ".body", ".h")
# A document the repository does not hold: the DS4 specification the code was first written from
# (spec/DS4_MODEL.md, spec/DS4_RUNTIME.md), cited by name or by its numbered sections ("spec §3.8", "(§4.4)").
FOREIGN_CITATIONS = [
    (re.compile(r"DS4_(?:MODEL|RUNTIME)\.md"), "cites DS4_MODEL.md / DS4_RUNTIME.md, not in the repository"),
    (re.compile(r"\bspec\s*§"), "cites a section of a 'spec' the repository does not hold"),
    (re.compile(r"§\s*\d"), "cites a numbered section (§) of a document the repository does not hold"),
]
# A document of the repository cited by heading: ``docs/MODEL.md, "Attention"`` (the path from the root, or from
# the citing file's folder), on one line so that it can be checked.
DOC_CITATION = re.compile(r'(?<![\w./-])((?:[\w.-]+/)*[\w.-]+\.md),\s*"([^"\n]+)"')
SPLIT_CITATION = re.compile(r'(?<![\w./-])(?:[\w.-]+/)*[\w.-]+\.md,\s*$')
FENCE = re.compile(r"\s*(```|~~~)")
HEADING = re.compile(r"#{1,6}\s+(.+?)\s*#*\s*$")


def repo_files() -> list[str]:
    """Repository-relative paths of the files a clone has (see the module docstring)."""
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
        if top.returncode == 0 and Path(top.stdout.strip()).resolve() == ROOT:
            out = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT,
                                 capture_output=True, timeout=60, check=True).stdout
            paths = [p for p in out.decode().split("\0") if p and (ROOT / p).is_file()]
            venvs = tuple(p[: -len("pyvenv.cfg")] for p in paths if p.endswith("/pyvenv.cfg"))
            return sorted({p for p in paths if not p.startswith(venvs)})
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
                if not ignored(rel, True) and not (p / "pyvenv.cfg").is_file():
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


def doc_headings(text: str) -> set[str]:
    """The names a Markdown document's headings may be cited by: each heading without its backticks, also without
    a trailing parenthesis ("Attention" for "Attention (`attention.py`, ...)") and the part before a colon
    ("Numerics" for "Numerics: the roundings ..."). Lines inside fenced code blocks are not headings."""
    names, fenced = set(), None
    for line in text.splitlines():
        fence = FENCE.match(line)
        if fence:
            fenced = None if fenced == fence.group(1) else fenced or fence.group(1)
            continue
        m = None if fenced else HEADING.match(line)
        if m:
            title = m.group(1).replace("`", "").strip()
            short = re.sub(r"\s*\([^()]*\)$", "", title)
            names |= {title, short, short.split(":", 1)[0].strip()}
    return names - {""}


@functools.lru_cache(maxsize=1)
def _repo_docs() -> dict[str, set[str]]:
    """``path -> heading names`` for every Markdown file of the repository."""
    return {rel: doc_headings((ROOT / rel).read_text(encoding="utf-8", errors="replace"))
            for rel in repo_files() if rel.endswith(".md")}


def _lines(rel: str, text: str) -> list[tuple[str, str]]:
    """``(where, line)`` for each line of ``text``: ``rel:N``, or for a notebook ``rel: cell C line N`` of the
    cells' own text (not the JSON around it)."""
    if rel.endswith(".ipynb"):
        try:
            cells = json.loads(text)["cells"]
            return [(f"{rel}: cell {c} line {n}", line)
                    for c, cell in enumerate(cells)
                    for n, line in enumerate("".join(cell.get("source", "")).splitlines(), 1)]
        except (ValueError, KeyError, TypeError, AttributeError):
            pass
    return [(f"{rel}:{n}", line) for n, line in enumerate(text.splitlines(), 1)]


def citation_offences(rel: str, text: str, docs: dict[str, set[str]] | None = None) -> list[str]:
    """What in file ``rel`` cites a document the repository does not hold, or a heading that its document lacks.

    ``docs`` maps the repository's Markdown files to their heading names (default: the repository's own)."""
    if not rel.endswith(CITING_SUFFIXES):
        return []
    docs = _repo_docs() if docs is None else docs
    found = []
    for where, line in _lines(rel, text):
        for pattern, what in FOREIGN_CITATIONS:
            if pattern.search(line):
                found.append(f"{where}: {what}: {line.strip()[:160]}")
                break
        for m in DOC_CITATION.finditer(line):
            doc, heading = m.group(1), m.group(2)
            path = next((p for p in (doc, posixpath.normpath(posixpath.join(posixpath.dirname(rel), doc)))
                         if p in docs), None)
            if path is None:
                found.append(f"{where}: cites {doc}, which the repository does not hold: {line.strip()[:160]}")
            elif heading not in docs[path]:
                found.append(f'{where}: cites "{heading}", which is not a heading of {path}: {line.strip()[:160]}')
        if SPLIT_CITATION.search(line):
            found.append(f'{where}: a citation split across lines (keep FILE.md, "Heading" on one line): '
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


def test_no_file_cites_a_document_outside_the_repository():
    """No comment, docstring, document or notebook cites the DS4 specification (not in the repository) or its
    numbered sections, and every ``docs/X.md, "Heading"`` citation names a heading that exists. The repository's
    documents are docs/MODEL.md (the model, the tokenizer, sampling), docs/FORMATS.md (GGUF, DSV4, KVC) and
    docs/GPU.md; ds4's own C sources (ds4.c, ds4_cuda.cu, ...) are public and may be cited by file and line."""
    found = []
    for rel in repo_files():
        text = None if rel == SELF else _text(rel)
        if text is not None:
            found += citation_offences(rel, text)
    assert not found, (f"{len(found)} citations a reader of the repository cannot follow (cite docs/MODEL.md or "
                       'docs/FORMATS.md by heading instead, as in docs/MODEL.md, "Attention"):\n' + "\n".join(found))


_NOTEBOOK = json.dumps({"cells": [
    {"cell_type": "markdown", "source": ["Pooling (docs/MODEL.md, \"Attention\")\n", "and the payload.\n"]},
    {"cell_type": "code", "source": "# FP8 round trip (spec §4.3)\nx = 1\n"},
]})


@pytest.mark.parametrize("rel, text, n", [
    ("ds4lab/x.py", '"""Pool every R tokens into one row (spec §3.6)."""', 1),
    ("ds4lab/x.py", "# The pending state has ds4's layout (spec/DS4_RUNTIME.md §2.4)", 1),
    ("ds4lab/x.py", '"""Token sampling (DS4_RUNTIME.md section 6.2)."""', 1),
    ("ds4lab/x.py", '"""FP8 E4M3 round trip per 64-block (§4.3)."""', 1),
    ("tests/test_x.py", "# straight from the spec text, ds4.c:16511", 0),
    ("ds4lab/x.py", '"""Pooling (docs/MODEL.md, "Attention"); rounding (docs/MODEL.md, "Numerics")."""', 0),
    ("ds4lab/x.py", '# (docs/FORMATS.md, "The DSV4 session payload"; FORMATS.md, "KVC files and the KV store")', 1),
    ("ds4lab/x.py", '# (docs/MODEL.md, "Notation"; README.md, "Command line"; docs/MODEL.md, "The head")', 0),
    ("ds4lab/x.py", '# (docs/MODEL.md, "Attention core with sinks")', 1),
    ("ds4lab/x.py", '# (docs/MODEL.md, "Attention (`attention.py`")', 1),
    ("ds4lab/x.py", '# (docs/SPEC.md, "Attention")', 1),
    ("ds4lab/x.py", '# (docs/MODEL.md,\n# "Attention")', 1),
    ("docs/x.md", 'as MODEL.md, "The head" and FORMATS.md, "GGUF model files" say', 0),
    ("docs/x.md", 'as MODEL.md, "The tail" says; spec/DS4_MODEL.md §3', 2),
    ("tests/test_x.py", 'assert "README.md" in files and "pyproject.toml" in files', 0),
    ("data/x.txt", "Cap. III, § 1, and spec/DS4_MODEL.md", 0),
    ("notebooks/x.ipynb", _NOTEBOOK, 1),
])
def test_the_citation_check_catches_what_it_should(rel, text, n):
    assert len(citation_offences(rel, text)) == n, citation_offences(rel, text)


def test_doc_headings_are_the_headings_outside_code_blocks():
    text = "# Title\n\n## Attention (`attention.py`)\n\n```\n# not a heading\n```\n### Numerics: the roundings\n"
    assert doc_headings(text) == {"Title", "Attention (attention.py)", "Attention", "Numerics: the roundings",
                                  "Numerics"}


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
