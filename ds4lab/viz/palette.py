"""The colours that mean the same thing in every view. Orange is the accent and means one thing: what the step
shown wrote, or what the reader picked (the chunk shown, a selected region or head, the active unit); nothing
else is orange, so a class learns it once (tests/test_views_extra.py holds the views' sources to this). Blue is
the raw window's rows and green the compressed rows, in every view that shows both (a student's walk-through read
the indexer's "kept" blue as raw rows beside the green of the compressed ones), purple the indexer's own rows in the
KV view; what is not a kind of row (tiers, the steps that move bytes between them, what a clock measured) takes
none of these hues (a teacher's walk-through read the tiers' blue and purple as rows).
The front-end (``widgets/*.js``, ``widgets/views.css``) writes the same values. One exception, kept on purpose: the
GenerationView's probability scale runs from blue (likely) to orange (surprising), the diverging pair that readers
with either red-green deficiency tell apart (pinks and purples fell within ΔE 4-8 of its grey); its key is always
shown beside it."""

from __future__ import annotations

ACCENT = "#e6550d"  # written by the step shown; the reader's pick
RAW = "#3182bd"  # the raw window's rows (the ring), and their keys in the attention's mass bars
COMPRESSED = "#31a354"  # the compressed rows
KEPT = COMPRESSED  # a compressed row the indexer selected is a compressed row a query sees: the rows it drops stand out
DROPPED = "#fcbba1"  # a compressed row the indexer did not select (salmon: pale, unlike the accent)
NOT_YET = "#ffffcc"  # a compressed row whose group of tokens is not complete yet
PENDING = "#fdd835"  # the tokens of that group, waiting: NOT_YET's yellow, deep enough to read as a bar
SINK = "#525252"  # the attention sink: a key whose value is zero, so it takes weight and adds nothing
MEASURED = "#252525"  # what a clock measured (the speed charts' points): black, as no kind of row is
PREDICTED = "#737373"  # what ds4lab.costs predicts, beside what was measured (dashed)
CLEAN = "#bdbdbd"  # a clean run's bar beside the edited one's (the edit is the reader's pick: the accent)
HASH_ROUTED = "#969696"  # a layer whose experts come from a fixed table of the token id, not a learned router
LEARNED_ROUTED = "#525252"  # one whose learned router picks them: a darker grey (blue and green are kinds of rows)
BATCH = "#525252"  # a step that moved a chunk's rows between tiers (a prefill chunk)
DECODE = "#969696"  # one that moved a token's row (a decode step): lighter, and 1/chunk as tall


def rgb(colour: str) -> tuple[int, int, int]:
    """``"#rrggbb"`` as a tuple of its three bytes (for the views drawn as images)."""
    return int(colour[1:3], 16), int(colour[3:5], 16), int(colour[5:7], 16)
