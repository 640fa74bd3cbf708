"""Micro-batches by token budget (`use_dynamic_bsz`): every row once, no micro-batch over
the budget, each cut to its own length, and the rows found again in their order."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.data.batch import (
    TrainingBatch,
    balanced_assignment,
    round_up,
    split_micro_batches,
    to_count_multiple,
    token_budget_partition,
)


def batch_of(prompt_and_response: list[tuple[int, int]], seq: int) -> TrainingBatch:
    ids = torch.arange(len(prompt_and_response) * seq).reshape(-1, seq) % 97 + 3
    mask = torch.zeros(len(prompt_and_response), seq)
    for i, (p, r) in enumerate(prompt_and_response):
        mask[i, p : p + r] = 1
    return TrainingBatch(
        input_ids=ids,
        response_mask=mask,
        advantages=torch.randn(ids.shape),
        scores=torch.ones(len(ids)),
    )


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=40),
    multiple=st.sampled_from([1, 2, 8]),
    slack=st.integers(0, 600),
)
def test_every_row_once_and_no_micro_batch_over_the_budget(lengths, multiple, slack):
    budget = round_up(max(lengths), multiple) + slack
    parts = token_budget_partition(lengths, budget, multiple)
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    for p in parts:
        longest = max(lengths[i] for i in p)
        assert lengths[p[0]] == longest  # the first row sets the padded length
        assert len(p) * round_up(longest, multiple) <= budget
    # Greedy over rows sorted by length: a micro-batch closes only when the next row would
    # not fit, so two consecutive micro-batches could not have been one.
    for a in parts[:-1]:
        assert (len(a) + 1) * round_up(lengths[a[0]], multiple) > budget


def test_long_tail_costs_its_own_tokens_not_every_micro_batchs():
    lengths = [2048] + [256] * 31
    parts = token_budget_partition(lengths, 4096, multiple=1)
    # The fewest micro-batches: [2048, 256] (one row padded), then 16 + 14 rows of 256.
    assert [len(p) for p in parts] == [2, 16, 14]
    padded = sum(len(p) * max(lengths[i] for i in p) for p in parts)
    assert padded == 11776 and padded * 5 < len(lengths) * max(lengths)  # all at 2048: 65536


def test_a_row_longer_than_the_budget_is_refused_with_the_option_named():
    with pytest.raises(
        ValueError, match=r"300 tokens \(padded to 304\).*ppo_max_token_len_per_gpu"
    ):
        token_budget_partition([10, 300], 256, multiple=8)


def test_split_cuts_each_micro_batch_to_its_length_and_keeps_every_value():
    rows = [(3, 2), (4, 15), (2, 1), (5, 9), (3, 4)]  # lengths 5, 19, 3, 14, 7
    batch = batch_of(rows, seq=19)
    assert batch.sequence_lengths().tolist() == [5, 19, 3, 14, 7]
    micro, order = split_micro_batches(batch, max_tokens=24, multiple=2)
    assert [tuple(m.input_ids.shape) for m in micro] == [(1, 20), (1, 14), (3, 8)]
    assert order.tolist() == [1, 3, 4, 0, 2]
    for m, rows_ in zip(micro, [[1], [3], [4, 0, 2]], strict=True):
        width = min(m.seq_length, batch.seq_length)
        for j, r in enumerate(rows_):
            assert torch.equal(m.input_ids[j, :width], batch.input_ids[r, :width])
            assert torch.equal(m.advantages[j, :width], batch.advantages[r, :width])
            # nothing of the loss is cut: every response token is inside the micro-batch
            assert m.response_mask[j].sum() == batch.response_mask[r].sum()
    # the longest row, 19 tokens, is padded to the multiple of 2 past the batch's 19 columns
    assert micro[0].input_ids[0, 19] == 0 and micro[0].response_mask[0, 19] == 0


def test_equal_split_is_unchanged_and_the_two_options_are_exclusive():
    batch = batch_of([(3, 2), (4, 15), (2, 1), (5, 9)], seq=21)
    micro, order = split_micro_batches(batch, num_microbatches=2, multiple=4)
    assert order is None and [tuple(m.input_ids.shape) for m in micro] == [(2, 24), (2, 24)]
    with pytest.raises(ValueError, match="num_microbatches=2 and max_tokens=64"):
        split_micro_batches(batch, num_microbatches=2, max_tokens=64)


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 2048), min_size=2, max_size=64),
    ranks=st.integers(1, 4),
)
def test_balanced_assignment_keeps_each_ranks_row_count(lengths, ranks):
    counts = [len(lengths) // ranks] * ranks
    counts[0] += len(lengths) - sum(counts)
    assignment = balanced_assignment(lengths, counts)
    assert [len(rows) for rows in assignment] == counts
    assert sorted(i for rows in assignment for i in rows) == list(range(len(lengths)))


def test_balanced_assignment_spreads_a_long_tail_over_the_ranks():
    # rank 0 sampled the long responses, rank 1 the short ones
    lengths = [2048, 1500, 900, 700, 100, 90, 80, 60]
    ranks = balanced_assignment(lengths, [4, 4])
    sums = [sum(lengths[i] for i in rows) for rows in ranks]
    assert sums == [2048 + 700 + 80 + 60, 1500 + 900 + 100 + 90]  # 2888 / 2590, was 5148 / 330
    with pytest.raises(ValueError, match="8 rows for ranks of \\[4, 3\\] rows"):
        balanced_assignment(lengths, [4, 3])


def test_interleaved_pipelines_get_a_multiple_of_their_size_in_micro_batches():
    parts = token_budget_partition([30, 20, 10, 10, 10], 60)  # [30, 20], [10, 10, 10]
    assert to_count_multiple(parts, 2) == parts
    assert to_count_multiple(parts, 3) == [[0, 1], [2], [3, 4]]  # the fullest one split
    assert to_count_multiple([[0], [1]], 1) == [[0], [1]]
    with pytest.raises(ValueError, match="2 rows cannot make a multiple of 4 micro-batches"):
        to_count_multiple([[0], [1]], 4)


def test_routed_experts_fill_every_run_token_and_placeholders_elsewhere():
    """Engine routes cover prompt + response - 1 tokens; the last token and padding get the
    distinct placeholder experts 0..k-1, also when the batch is padded or split."""
    from types import SimpleNamespace

    import numpy as np

    from megatron_rl.data.batch import samples_to_batch

    def sample(prompt, response, fill):
        routes = np.full((len(prompt) + len(response) - 1, 2, 2), fill, dtype=np.uint8)
        routes[..., 1] = fill + 1
        return SimpleNamespace(prompt_token_ids=prompt, token_ids=response, routed_experts=routes)

    batch = samples_to_batch([sample([1, 2], [3, 4, 5], 6), sample([7], [8], 4)])
    r = batch.routed_experts
    assert r.shape == (2, 5, 2, 2) and r.dtype == torch.uint8
    assert r[0, :4].tolist() == [[[6, 7]] * 2] * 4 and r[0, 4].tolist() == [[0, 1]] * 2
    assert r[1, :1].tolist() == [[[4, 5]] * 2] and r[1, 1:].tolist() == [[[0, 1]] * 2] * 4
    padded = batch.padded_to_multiple(4)
    assert padded.routed_experts.shape == (2, 8, 2, 2)
    assert padded.routed_experts[:, 5:].tolist() == [[[[0, 1]] * 2] * 3] * 2
    assert torch.equal(batch.with_length(3).routed_experts, r[:, :3])
    short = SimpleNamespace(
        prompt_token_ids=[1, 2], token_ids=[3, 4, 5], routed_experts=np.zeros((3, 2, 2), np.uint8)
    )
    with pytest.raises(ValueError, match=r"sample 0: .* \(3, 2, 2\), expected \(4, 2, 2\)"):
        samples_to_batch([short])
    with pytest.raises(ValueError, match="routed_experts has shape"):
        batch.with_fields(routed_experts=r[:, :, 0])
