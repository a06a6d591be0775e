"""Fixed numbers of the DS4 architecture that the GGUF metadata does not carry (docs/MODEL.md).

The model's reference formulas, the KV layout and the kernels all read them from here, so a kernel never
imports the model to learn a constant.
"""

from __future__ import annotations

NEG_INF = -1e30  # ds4's "minus infinity": masked compressor candidates, the pending score state's start
ROUTER_SUM_FLOOR = 2.0 ** -14  # the smallest sum a token's routed-expert weights are divided by


def coff(ratio: int) -> int:
    """Windows a compressor's pending state spans: two for ratio 4 (they overlap), one otherwise."""
    return 2 if ratio == 4 else 1


def n_blocks(ratio: int, chunk: int) -> int:
    """Windows on the timeline of a chunk: the state's windows plus every window the chunk can touch."""
    return coff(ratio) + chunk // ratio + 1
