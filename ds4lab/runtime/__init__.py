"""How a chunk runs: :class:`Runtime` over the model's math (:mod:`ds4lab.model`).

- :mod:`.runtime`: :class:`Runtime` — token and position checks, padding, tier switches, the choice between
  eager and compiled calls, and the caches of compiled calls;
- :mod:`.tables`: :class:`ChunkTables`, the RoPE tables (and device scalars) a chunk's layers read;
- :mod:`.compiled`: the model's blocks as functions of arrays only (an attention half, an FFN half, the
  whole step), and the flattening of layer states they take and give.
"""

from .runtime import Runtime
from .tables import ChunkTables

__all__ = ["ChunkTables", "Runtime"]
