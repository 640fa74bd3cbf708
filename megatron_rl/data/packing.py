"""Packed micro-batches: a micro-batch's rows back to back in one row, with no padding.

A right-padded micro-batch of rows of lengths l_1..l_n costs n x max(l) tokens; packed, it
costs sum(l) (rounded up to the sequence multiple of SP/FP8). The model runs on the packed row
in megatron-core's `thd` layout: `PackedSeqParams` carries the segment boundaries, the rotary
embedding restarts at each segment (megatron's thd RoPE), and attention stays within each
segment (`models/attention.py`). verl calls this `use_remove_padding`, NeMo-RL sequence
packing.

Everything outside the model keeps the micro-batch's usual [b, s] layout: a per-position
output of the packed row (log-prob, entropy, value, all about the next token) is put back
with `Packing.to_tokens`, so every loss and estimator reads the same tensors as unpacked.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Packing:
    """Where the tokens of a [b, s] micro-batch lie in its packed row of T tokens."""

    input_ids: torch.Tensor
    """[1, T] the rows' tokens up to each row's length, back to back; padding at the end."""
    position_ids: torch.Tensor
    """[1, T] each token's position within its own row (restarting at 0)."""
    cu_seqlens: torch.Tensor
    """[n + 1] int32 segment boundaries (the trailing padding, if any, is a segment too)."""
    bounds: tuple[int, ...]
    """The same boundaries on the host: attention slices its segments by them, where reading
    `cu_seqlens` back would make the host wait for the device at every layer."""
    next_index: torch.Tensor
    """[T] long: for the packed token at p, the index in the flattened [b, s] layout of the
    token after it in its row; b * s (a slot past the end, dropped) where none is (a row's
    last token, padding)."""
    shape: tuple[int, int]
    """(b, s) of the unpacked micro-batch."""

    @property
    def max_seqlen(self) -> int:
        return max(end - start for start, end in zip(self.bounds, self.bounds[1:], strict=False))

    def to(self, device: torch.device) -> Packing:
        return Packing(
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            cu_seqlens=self.cu_seqlens.to(device),
            bounds=self.bounds,
            next_index=self.next_index.to(device),
            shape=self.shape,
        )

    def packed_seq_params(self):
        """megatron-core's `PackedSeqParams` of these segments, carrying `bounds` as
        `host_bounds` (read by `models/attention.py`)."""
        # why: megatron-core takes seconds to import: loaded on first use
        from megatron.core.packed_seq_params import PackedSeqParams

        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )
        params.host_bounds = self.bounds
        return params

    def next_tokens(self) -> torch.Tensor:
        """[1, T] the label of each packed position: the next token of the packed row (at a
        row's last token that is the next row's first; `to_tokens` drops it)."""
        return torch.roll(self.input_ids, -1, dims=1)

    def to_tokens(self, per_position: torch.Tensor) -> torch.Tensor:
        """[1, T] or [T] values computed at each packed position about the next token ->
        [b, s] aligned to tokens like `batch.shift_to_tokens` of the unpacked rows (0 at
        column 0 and past each row's length). Differentiable; no host read (the positions
        without a next token write into the dropped slot, not through a boolean mask)."""
        n = self.shape[0] * self.shape[1]
        out = per_position.new_zeros(n + 1).index_put((self.next_index,), per_position.reshape(-1))
        return out[:n].view(self.shape)


def pack_rows(input_ids: torch.Tensor, lengths: list[int], multiple: int = 1) -> Packing:
    """Pack `input_ids` [b, s], row i's first `lengths[i]` tokens (given on the host: the
    bounds are host numbers, `Packing.bounds`), into one row whose length is a multiple of
    `multiple` (zero tokens of a segment of their own at the end)."""
    b, s = input_ids.shape
    if len(lengths) != b or any(not 1 <= n <= s for n in lengths):
        raise ValueError(f"row lengths {list(lengths)}: expected {b} lengths in 1..{s}")
    device = input_ids.device
    total = sum(lengths)
    padded = -(-total // multiple) * multiple
    bounds = [0, *itertools.accumulate(lengths)]
    if padded > total:
        bounds.append(padded)
    lengths_d = torch.tensor(lengths, device=device)
    starts = torch.cumsum(lengths_d, 0) - lengths_d
    # each packed token's row and column in the [b, s] layout (sizes given: no host read)
    row = torch.arange(b, device=device).repeat_interleave(lengths_d, output_size=total)
    col = torch.arange(total, device=device) - starts[row]
    flat = row * s + col
    ids = torch.zeros(1, padded, dtype=input_ids.dtype, device=device)
    ids[0, :total] = input_ids.reshape(-1)[flat]
    positions = torch.zeros(1, padded, dtype=torch.long, device=device)
    positions[0, :total] = col
    next_index = torch.full((padded,), b * s, dtype=torch.long, device=device)
    next_index[:total] = torch.where(col < lengths_d[row] - 1, flat + 1, b * s)
    return Packing(
        input_ids=ids,
        position_ids=positions,
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=device),
        bounds=tuple(bounds),
        next_index=next_index,
        shape=(b, s),
    )


def packed_partition(lengths: list[int], max_tokens: int, multiple: int = 1) -> list[list[int]]:
    """Rows -> micro-batches of at most `max_tokens` packed tokens each (their lengths'
    sum, rounded up to `multiple`): first fit, longest first. Returns row indices per
    micro-batch, in the order they were opened (the longest row's first)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    parts: list[list[int]] = []
    sums: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if -(-lengths[i] // multiple) * multiple > max_tokens:
            raise ValueError(
                f"a sequence of {lengths[i]} tokens does not fit the micro-batch token budget "
                f"{max_tokens}: raise ppo_max_token_len_per_gpu to at least max_prompt_length "
                "+ max_new_tokens"
            )
        fit = next(
            (
                k
                for k, t in enumerate(sums)
                if -(-(t + lengths[i]) // multiple) * multiple <= max_tokens
            ),
            None,
        )
        if fit is None:
            parts.append([i])
            sums.append(lengths[i])
        else:
            parts[fit].append(i)
            sums[fit] += lengths[i]
    return parts
