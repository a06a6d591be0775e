"""Plain-text tables and counted words, for reprs and printed summaries (a notebook shows them in a monospace font)."""

from __future__ import annotations

from typing import Collection, Sequence


def aligned(head: Sequence, rows: Sequence[Sequence], left: Collection[int] = (), sep: str = " ") -> list[str]:
    """``head`` and ``rows`` as lines, each column as wide as its widest cell: right-aligned, so that numbers line
    up, but for the columns at the indices in ``left``; cells joined by ``sep``."""
    table = [[str(c) for c in row] for row in (head, *rows)]
    widths = [max(len(c) for c in column) for column in zip(*table)]
    return [sep.join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
            for row in table]


def runs(numbers: Sequence[int]) -> str:
    """Ascending integers as runs: [0, 1, 2, 5] -> "0-2, 5"."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)


def plural(n: int, one: str, many: str | None = None) -> str:
    """``1 switch``, ``5 switches``: ``n`` and the word that goes with it (``many`` defaults to ``one + "s"``)."""
    return f"{n} {one if n == 1 else (many or one + 's')}"


def layer_kind(ratio: int) -> str:
    """A layer's kind by its compression ratio, as the views name it: "raw only", "ratio 4", "ratio 128"."""
    return f"ratio {ratio}" if ratio else "raw only"
