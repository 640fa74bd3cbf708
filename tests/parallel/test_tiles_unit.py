"""The chunked head's tiles (`parallel.tiles.tile_shape`): bounded, square where both the
micro-batch and the vocabulary slice are long, whole where either is short."""

import pytest

from megatron_rl.parallel.tiles import TILE_ELEMENTS, tile_shape


@pytest.mark.parametrize(
    ("tokens", "rows", "want"),
    [
        (16384, 151936, (8192, 8192)),  # qwen2.5-0.5b, one 16k-token sequence: square
        (4096, 151936, (4096, 16384)),  # a shorter micro-batch: one block of tokens
        (100, 151936, (100, 151936)),  # shorter still: the whole slice, as token chunks did
        (4096, 19008, (4096, 16384)),  # a 152k vocabulary over TP8
        (65536, 512, (TILE_ELEMENTS // 512, 512)),  # a tiny vocabulary: one block of rows
        (65536, 8192, (8192, 8192)),  # exactly the square's side
        (10, 0, (TILE_ELEMENTS, 1)),  # a rank holding only vocabulary padding
    ],
)
def test_tile_shapes(tokens, rows, want):
    assert tile_shape(tokens, rows) == want


@pytest.mark.parametrize("tokens", [1, 7, 8191, 8193, 100_000])
@pytest.mark.parametrize("rows", [1, 500, 8191, 8193, 152_064])
def test_a_tile_never_holds_more_than_its_elements(tokens, rows):
    t, r = tile_shape(tokens, rows)
    assert t >= 1 and 1 <= r <= max(rows, 1)
    assert t * r <= TILE_ELEMENTS
