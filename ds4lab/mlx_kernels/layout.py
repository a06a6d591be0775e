"""How the kernels' weights lie in device memory: GGUF's blocks as they are, but Q8_0's regrouped into tiles.

A Q8_0 block is 34 bytes (a half scale, then 32 int8 quants), so a lane that reads its own block reads at a
2-byte aligned address: nine narrow loads, and a SIMD group's load spans nine cache lines. ds4lab's kernels read
Q8_0 rows as *tiles* of eight blocks (256 elements, 272 bytes, the same bytes as the eight blocks): bytes
``[16j, 16j + 16)`` hold the first 16 quants of block j, ``[128 + 16j, 128 + 16j + 16)`` its last 16, and
``[256 + 2j, 256 + 2j + 2)`` its scale. A lane then takes its block in two 16-byte loads, and eight lanes' first
loads are one 128-byte line. A row whose length is not a multiple of 256 ends in a tile padded with zero blocks (so
its rows are longer than GGUF's; Flash's are all multiples of 256). Backends with kernels upload weights through
:func:`blocks`; the element decoders of ``sources/common.h`` read this layout."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q

from .. import quants

TILE_BLOCKS = 8  # Q8_0 blocks a tile
TILE_BYTES = 34 * TILE_BLOCKS


def row_bytes(qtype: Q | int, ne0: int) -> int:
    """Bytes of a row of ``ne0`` elements as the kernels read it."""
    gguf = quants.row_bytes(qtype, ne0)  # refuses a length that is not whole blocks
    return -(-ne0 // (32 * TILE_BLOCKS)) * TILE_BYTES if Q(qtype) == Q.Q8_0 else gguf


def blocks(raw, qtype: Q | int, xp=np):
    """GGUF rows ``raw [..., row_bytes]`` (uint8, an array of ``xp``: NumPy, CuPy or MLX) in the kernels' layout
    ``[..., layout.row_bytes]``: the same array for every type but Q8_0, whose rows become tiles."""
    if Q(qtype) != Q.Q8_0:
        return raw
    lead, n_blocks = tuple(raw.shape[:-1]), raw.shape[-1] // 34
    tiles = -(-n_blocks // TILE_BLOCKS)
    b = raw.reshape(-1, n_blocks * 34)
    if tiles * TILE_BLOCKS != n_blocks:  # the last tile's missing blocks as zeros
        b = xp.concatenate([b, xp.zeros((b.shape[0], (tiles * TILE_BLOCKS - n_blocks) * 34), dtype=b.dtype)], axis=1)
    # one gather of each tile's bytes, on the array's own device: at the peak the weight's bytes and its tiles
    t = b.reshape(b.shape[0], tiles, TILE_BYTES)
    return xp.take(t, xp.asarray(_TILE_ORDER), axis=-1).reshape(*lead, tiles * TILE_BYTES)


def _tile_order() -> np.ndarray:
    """For each byte of a tile, the byte of its eight GGUF blocks it is: the first 16 quants of each block, then
    their last 16, then their scales (the module's docstring)."""
    block = 34 * np.arange(TILE_BLOCKS)[:, None]
    return np.concatenate([(block + 2 + np.arange(16)).ravel(), (block + 18 + np.arange(16)).ravel(),
                           (block + np.arange(2)).ravel()]).astype(np.int32)


_TILE_ORDER = _tile_order()

