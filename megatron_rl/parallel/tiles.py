"""The chunked head's tiles: how many tokens and vocabulary rows one tile of its fp32 logits
holds (`parallel.vocab.chunked_logprobs_entropy`, priced by `memory_plan`). Imports no torch."""

from __future__ import annotations

import math

TILE_ELEMENTS = 2**26
"""fp32 logits in one tile (256 MiB; backward holds about four tensors of its size at once)."""


def tile_shape(tokens: int, rows: int, elements: int = TILE_ELEMENTS) -> tuple[int, int]:
    """(tokens, vocabulary rows) of one tile of `elements` logits, for `tokens` tokens over
    `rows` rows of this rank's vocabulary slice.

    Backward accumulates the projection's gradient [rows, h] in fp32 once per block of tokens,
    and the hidden states' gradient [tokens, h] once per block of rows: bytes proportional
    to rows / tile tokens + tokens / tile rows, least for a square tile (8,192 x 8,192).
    Chunks of tokens over the whole vocabulary (441 tokens at 152k) read and wrote the 545 MB
    gradient of qwen2.5-0.5b's projection once per 441 tokens: 0.7 ms a chunk on an H200,
    27 ms of a 16k-token step (bench/gpu.md). A slice no wider than the square's side is one
    block of rows (a small vocabulary: one tile holds a whole micro-batch), a micro-batch
    shorter than the side one block of tokens."""
    side = math.isqrt(elements)
    if rows <= side:
        return max(1, elements // max(rows, 1)), max(rows, 1)
    block = max(1, min(tokens, side))
    return block, min(rows, elements // block)
