"""How the kernels' weights lie in device memory: GGUF's blocks as they are, but Q8_0's, IQ2_XXS's and Q2_K's
regrouped into tiles.

A Q8_0 block is 34 bytes (a half scale, then 32 int8 quants), so a lane that reads its own block reads at a
2-byte aligned address: nine narrow loads, and a SIMD group's load spans nine cache lines. ds4lab's kernels read
Q8_0 rows as *tiles* of eight blocks (256 elements, 272 bytes, the same bytes as the eight blocks): bytes
``[16j, 16j + 16)`` hold the first 16 quants of block j, ``[128 + 16j, 128 + 16j + 16)`` its last 16, and
``[256 + 2j, 256 + 2j + 2)`` its scale. A lane then takes its block in two 16-byte loads, and eight lanes' first
loads are 128 contiguous bytes.

An IQ2_XXS block is 66 bytes (a half scale, then eight 8-byte sub-blocks of 32 elements), so a lane's sub-block
starts 2 bytes past a word in every other block: two word loads and a 16-bit one, funnel-shifted together. Its
tiles are four blocks (1,024 elements, 264 bytes: one step of a SIMD group's decode loop): bytes ``[64j, 64j +
64)`` hold block j's sub-blocks, ``[256 + 2j, 256 + 2j + 2)`` its scale, so a lane takes its sub-block in one
8-byte load and a SIMD group's 32 loads are 256 contiguous bytes.

A Q2_K block is 84 bytes (16 bytes of scales and minima, 64 of two-bit quants, then d and dmin), so a lane's 16
bytes of quants start 4 bytes past a 16-byte boundary: four word loads. Its tiles are four blocks (1,024 elements,
336 bytes): ``[64j, 64j + 64)`` block j's quants, ``[256 + 16j, 256 + 16j + 16)`` its scales and minima, ``[320 +
4j, 320 + 4j + 4)`` its d and dmin, so a lane takes its quants in one 16-byte load.

A row whose length is not a multiple of a tile's elements ends in a tile padded with zero blocks (so its rows are
longer than GGUF's; Flash's are all whole tiles). Backends with kernels upload weights through :func:`blocks`;
the element decoders of ``sources/common.h`` read this layout."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as Q

from .. import quants


@dataclass(frozen=True)
class Tiling:
    """A type's tiles: ``blocks`` GGUF blocks of ``block_elements`` elements and ``block_bytes`` bytes, whose
    ``fields`` (offset, length in a block) a tile holds in turn: every block's first field, then every block's
    second, ... (the module's docstring)."""

    blocks: int
    block_elements: int
    block_bytes: int
    fields: tuple[tuple[int, int], ...]

    @property
    def tile_bytes(self) -> int:
        return self.blocks * self.block_bytes

    @property
    def elements(self) -> int:
        return self.blocks * self.block_elements

    def order(self) -> np.ndarray:
        """For each byte of a tile, the byte of its GGUF blocks it is."""
        block = self.block_bytes * np.arange(self.blocks)[:, None]
        return np.concatenate([(block + at + np.arange(n)).ravel() for at, n in self.fields]).astype(np.int32)


TILINGS = {Q.Q8_0: Tiling(blocks=8, block_elements=32, block_bytes=34, fields=((2, 16), (18, 16), (0, 2))),
           Q.IQ2_XXS: Tiling(blocks=4, block_elements=256, block_bytes=66, fields=((2, 64), (0, 2))),
           Q.Q2_K: Tiling(blocks=4, block_elements=256, block_bytes=84, fields=((16, 64), (0, 16), (80, 4)))}
_ORDERS = {q: t.order() for q, t in TILINGS.items()}


def row_bytes(qtype: Q | int, ne0: int) -> int:
    """Bytes of a row of ``ne0`` elements as the kernels read it."""
    gguf = quants.row_bytes(qtype, ne0)  # refuses a length that is not whole blocks
    tiling = TILINGS.get(Q(qtype))
    return gguf if tiling is None else -(-ne0 // tiling.elements) * tiling.tile_bytes


def blocks(raw, qtype: Q | int, xp=np):
    """GGUF rows ``raw [..., row_bytes]`` (uint8, an array of ``xp``: NumPy, CuPy or MLX) in the kernels' layout
    ``[..., layout.row_bytes]``: the same array for every type but the tiled ones (:data:`TILINGS`)."""
    tiling = TILINGS.get(Q(qtype))
    if tiling is None:
        return raw
    lead, n_blocks = tuple(raw.shape[:-1]), raw.shape[-1] // tiling.block_bytes
    tiles = -(-n_blocks // tiling.blocks)
    b = raw.reshape(-1, n_blocks * tiling.block_bytes)
    if tiles * tiling.blocks != n_blocks:  # the last tile's missing blocks as zeros
        pad = (tiles * tiling.blocks - n_blocks) * tiling.block_bytes
        b = xp.concatenate([b, xp.zeros((b.shape[0], pad), dtype=b.dtype)], axis=1)
    # one gather of each tile's bytes, on the array's own device: at the peak the weight's bytes and its tiles
    t = b.reshape(b.shape[0], tiles, tiling.tile_bytes)
    return xp.take(t, xp.asarray(_ORDERS[Q(qtype)]), axis=-1).reshape(*lead, tiles * tiling.tile_bytes)
