"""Packed micro-batches (`data/packing.py`): where each row's tokens go in the packed row,
and outputs put back exactly where the unpacked batch has them."""

import pytest
import torch

from megatron_rl.data.batch import TrainingBatch, shift_to_tokens, split_micro_batches
from megatron_rl.data.packing import pack_rows, packed_partition
from tests.host_reads import HostReads


def batch_of(lengths, seq=7):
    ids = torch.arange(1, len(lengths) * seq + 1).view(len(lengths), seq)
    mask = torch.zeros(len(lengths), seq)
    for i, n in enumerate(lengths):
        mask[i, 1:n] = 1  # prompt of one token, response to the row's length
    return TrainingBatch(input_ids=ids, response_mask=mask)


def test_rows_lie_back_to_back_with_positions_restarting_and_padding_last():
    batch = batch_of([3, 5, 2])
    p = pack_rows(batch.input_ids, [3, 5, 2], multiple=4)
    ids = batch.input_ids
    expected = torch.cat([ids[0, :3], ids[1, :5], ids[2, :2], torch.zeros(2, dtype=ids.dtype)])
    assert torch.equal(p.input_ids[0], expected)
    assert p.position_ids[0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 0, 0]
    assert p.cu_seqlens.tolist() == [0, 3, 8, 10, 12] and p.cu_seqlens.dtype == torch.int32
    assert p.bounds == (0, 3, 8, 10, 12) and p.max_seqlen == 5
    params = p.packed_seq_params()  # what the model's attention reads
    assert params.cu_seqlens_q is params.cu_seqlens_kv is p.cu_seqlens
    assert params.host_bounds == p.bounds and params.max_seqlen_q == 5


@pytest.mark.parametrize("lengths", [[3, 8], [0, 2], [3]])
def test_row_lengths_outside_the_rows_are_refused(lengths):
    ids = torch.ones(2, 7, dtype=torch.long)
    with pytest.raises(ValueError, match=r"row lengths \[.*\]: expected 2 lengths in 1..7"):
        pack_rows(ids, lengths)


def test_outputs_go_back_where_the_unpacked_batch_has_them():
    """A per-position value about the next token lands on that token's column, as
    `shift_to_tokens` puts it for the unpacked rows; nothing lands past a row's length."""
    batch = batch_of([3, 5, 2])
    p = pack_rows(batch.input_ids, [3, 5, 2], multiple=4)
    unpacked = batch.input_ids.float() * 10  # any per-position value
    packed = torch.zeros(p.input_ids.shape[1])
    lengths = [3, 5, 2]
    packed[:10] = torch.cat([unpacked[i, :n] for i, n in enumerate(lengths)])
    seen = torch.arange(7) < torch.tensor(lengths)[:, None]
    expected = torch.where(seen, shift_to_tokens(unpacked[:, :-1]), 0.0)
    assert torch.equal(p.to_tokens(packed), expected)
    # the labels: the next token of the packed row, the right one inside each row
    labels = p.next_tokens()[0]
    assert labels[0] == batch.input_ids[0, 1] and labels[3] == batch.input_ids[1, 1]


def test_to_tokens_carries_gradients():
    batch = batch_of([3, 4])
    p = pack_rows(batch.input_ids, [3, 4])
    x = torch.randn(p.input_ids.shape[1], requires_grad=True)
    p.to_tokens(x).sum().backward()
    # every position but each row's last feeds a token
    assert x.grad.tolist() == [1, 1, 0, 1, 1, 1, 0]


def test_packing_and_putting_back_read_nothing_from_the_device():
    """A GPU would wait for its queue at each read: the split reads the rows' lengths once
    for all its micro-batches, and packing them and putting a per-position output back read
    nothing more."""
    batch = batch_of([3, 5, 2, 6])
    with HostReads() as reads:
        micro, _ = split_micro_batches(batch, num_microbatches=2, multiple=4, pack=True)
        x = torch.randn(micro[0].model_input_ids.shape[1], requires_grad=True)
        micro[0].packing.to_tokens(x).sum().backward()
    assert dict(reads.sites) == {
        "tolist megatron_rl/data/batch.py:split_micro_batches": 1,
    }
    assert [mb.packing.bounds for mb in micro] == [(0, 3, 8), (0, 2, 8)]


def test_packed_partition_counts_packed_tokens_first_fit_longest_first():
    assert packed_partition([5, 3, 4, 2], max_tokens=7) == [[0, 3], [2, 1]]
    # rounded up to 4: 5 + 3 -> 8 fits, 5 + 4 -> 12 does not
    assert packed_partition([5, 3, 4, 2], max_tokens=8, multiple=4) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="9 tokens does not fit the micro-batch token budget 8"):
        packed_partition([9], max_tokens=8)


def test_packed_micro_batches_keep_their_rows_and_cost_their_tokens():
    batch = batch_of([7, 2, 3, 2, 6])
    micro, order = split_micro_batches(batch, max_tokens=9, pack=True)
    assert sorted(order.tolist()) == list(range(5))
    assert all(mb.packing is not None for mb in micro)
    packed_tokens = sum(mb.model_input_ids.shape[1] for mb in micro)
    assert packed_tokens == 7 + 2 + 3 + 2 + 6  # no padding at all
    padded = sum(mb.input_ids.numel() for mb in split_micro_batches(batch, max_tokens=9)[0])
    assert padded > packed_tokens
    with pytest.raises(ValueError, match="not split again"):
        micro[0].rows(slice(0, 1))
