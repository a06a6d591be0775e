"""The kernels' weight layout (ds4lab.mlx_kernels.layout): Q8_0 rows regrouped into tiles of eight blocks and
IQ2_XXS and Q2_K rows into tiles of four, byte for byte where the module's docstring puts them, and every other
type left as GGUF has it."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from ds4lab.mlx_kernels import layout
from ds4lab.quants import random_blocks
from ds4lab.quants import row_bytes as gguf_row_bytes


def _on_mlx(raw, qtype=Q.Q8_0):
    mx = pytest.importorskip("mlx.core")
    return np.array(layout.blocks(mx.array(raw), qtype, mx))


# one gather whatever the array library: NumPy's on the host, MLX's (as CuPy's on its device)
TILERS = {"numpy": lambda raw, qtype=Q.Q8_0: layout.blocks(raw, qtype), "mlx": _on_mlx}


@pytest.mark.parametrize("tiler", TILERS)
@pytest.mark.parametrize("ne0", [32, 96, 256, 1024, 4096 + 64])
def test_q8_0_tiles_put_each_byte_where_the_docstring_says(ne0, tiler):
    raw = random_blocks(Q.Q8_0, (3, 5), ne0, np.random.default_rng(ne0), 0.05)
    got = TILERS[tiler](raw)
    n_blocks, tiles = ne0 // 32, -(-ne0 // 256)
    assert got.shape == (3, 5, layout.row_bytes(Q.Q8_0, ne0)) == (3, 5, 272 * tiles)
    want = np.zeros((3, 5, tiles, 272), np.uint8)  # padding blocks: zero quants, zero scale
    for b in range(n_blocks):  # a loop per block, written from the docstring, not from blocks()'s reshapes
        t, j = divmod(b, 8)
        block = raw[..., 34 * b:34 * (b + 1)]
        want[..., t, 256 + 2 * j:258 + 2 * j] = block[..., :2]
        want[..., t, 16 * j:16 * j + 16] = block[..., 2:18]
        want[..., t, 128 + 16 * j:144 + 16 * j] = block[..., 18:34]
    np.testing.assert_array_equal(got, want.reshape(got.shape))


@pytest.mark.parametrize("tiler", TILERS)
@pytest.mark.parametrize("ne0", [256, 768, 1024, 4096, 4096 + 256])
def test_iq2_xxs_tiles_put_each_byte_where_the_docstring_says(ne0, tiler):
    raw = random_blocks(Q.IQ2_XXS, (3, 5), ne0, np.random.default_rng(ne0), 0.05)
    got = TILERS[tiler](raw, Q.IQ2_XXS)
    n_blocks, tiles = ne0 // 256, -(-ne0 // 1024)
    assert got.shape == (3, 5, layout.row_bytes(Q.IQ2_XXS, ne0)) == (3, 5, 264 * tiles)
    want = np.zeros((3, 5, tiles, 264), np.uint8)  # padding blocks: zero quants, zero scale
    for b in range(n_blocks):  # a loop per block, written from the docstring
        t, j = divmod(b, 4)
        block = raw[..., 66 * b:66 * (b + 1)]
        want[..., t, 256 + 2 * j:258 + 2 * j] = block[..., :2]
        want[..., t, 64 * j:64 * j + 64] = block[..., 2:66]
    np.testing.assert_array_equal(got, want.reshape(got.shape))


def test_iq2_xxs_rows_of_whole_tiles_keep_their_length_and_sub_blocks_start_8_byte_aligned():
    for ne0 in (1024, 2048, 4096):  # Flash's IQ2_XXS rows (the routed gate and up: 4096)
        assert layout.row_bytes(Q.IQ2_XXS, ne0) == gguf_row_bytes(Q.IQ2_XXS, ne0)
        assert layout.row_bytes(Q.IQ2_XXS, ne0) % 8 == 0
    tiling = layout.TILINGS[Q.IQ2_XXS]  # every sub-block of every tile of a row at a multiple of 8
    (at, size), _ = tiling.fields
    assert at == 2 and size == 8 * 8
    starts = [t * tiling.tile_bytes + size * j + 8 * s
              for t in range(4) for j in range(tiling.blocks) for s in range(8)]
    assert all(b % 8 == 0 for b in starts) and len(set(starts)) == 4 * tiling.blocks * 8


@pytest.mark.parametrize("tiler", TILERS)
@pytest.mark.parametrize("ne0", [256, 1024, 2048, 2048 + 512])
def test_q2_k_tiles_put_each_byte_where_the_docstring_says(ne0, tiler):
    raw = random_blocks(Q.Q2_K, (3, 5), ne0, np.random.default_rng(ne0), 0.05)
    got = TILERS[tiler](raw, Q.Q2_K)
    n_blocks, tiles = ne0 // 256, -(-ne0 // 1024)
    assert got.shape == (3, 5, layout.row_bytes(Q.Q2_K, ne0)) == (3, 5, 336 * tiles)
    want = np.zeros((3, 5, tiles, 336), np.uint8)  # padding blocks: zeros
    for b in range(n_blocks):  # a loop per block, written from the docstring
        t, j = divmod(b, 4)
        block = raw[..., 84 * b:84 * (b + 1)]
        want[..., t, 64 * j:64 * j + 64] = block[..., 16:80]
        want[..., t, 256 + 16 * j:272 + 16 * j] = block[..., :16]
        want[..., t, 320 + 4 * j:324 + 4 * j] = block[..., 80:84]
    np.testing.assert_array_equal(got, want.reshape(got.shape))


def test_q2_k_rows_of_whole_tiles_keep_their_length_and_quants_start_16_byte_aligned():
    for ne0 in (1024, 2048, 4096):  # Flash's Q2_K rows (the routed down: 2048)
        assert layout.row_bytes(Q.Q2_K, ne0) == gguf_row_bytes(Q.Q2_K, ne0)
        assert layout.row_bytes(Q.Q2_K, ne0) % 16 == 0
    tiling = layout.TILINGS[Q.Q2_K]  # a block's quants, 64 bytes first in its tile: four 16-byte aligned runs
    (at, size), *_ = tiling.fields
    assert at == 16 and size == 64
    assert all((t * tiling.tile_bytes + size * j + 16 * h) % 16 == 0 for t in range(4) for j in range(tiling.blocks)
               for h in range(4))


def test_q8_0_rows_of_whole_tiles_keep_their_length_and_rows_start_16_byte_aligned():
    for ne0 in (256, 1024, 4096, 32768):  # Flash's Q8_0 row lengths are multiples of 256
        assert layout.row_bytes(Q.Q8_0, ne0) == gguf_row_bytes(Q.Q8_0, ne0)
        assert layout.row_bytes(Q.Q8_0, ne0) % 16 == 0
    assert layout.row_bytes(Q.Q8_0, 64) % 16 == 0


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q4_K])
def test_other_types_are_left_as_they_are(qtype):
    raw = np.arange(2 * gguf_row_bytes(qtype, 256), dtype=np.uint16).astype(np.uint8).reshape(2, -1)
    assert layout.blocks(raw, qtype) is raw
    assert layout.row_bytes(qtype, 256) == gguf_row_bytes(qtype, 256)


def test_a_row_of_partial_blocks_is_refused_with_its_length():
    with pytest.raises(ValueError, match="ne0=40"):
        layout.row_bytes(Q.Q8_0, 40)
