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
