"""Every collective the algorithms need, written once.

Token-level losses, whitening and explained variance are statistics of the DP-global batch:
each data-parallel rank holds some rows, so counts, sums and moments are all-reduced over the
data-parallel group (identity with one DP rank); metrics are reduced over every rank; a stop
request on any rank stops all of them. No other module all-reduces for these.

Devices: under NCCL (every group on GPU) a collective takes only CUDA tensors, so the
metadata made here (counts, flags, sizes) is made on `distributed.device()`, and data tensors
are reduced on the device they arrive on (the role's). Object collectives (`reduce_over_ranks`,
`*_over_model_parallel`) pickle through the current CUDA device by themselves.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rl.algorithms.losses import explained_variance_of, token_and_sequence_counts
from megatron_rl.algorithms.masked import Moments
from megatron_rl.data.batch import TrainingBatch, balanced_assignment
from megatron_rl.parallel import distributed


def _data_parallel_group():
    # why: megatron-core takes seconds to import: loaded on first use
    from megatron.core import parallel_state

    if parallel_state.get_data_parallel_world_size() == 1:
        return None
    return parallel_state.get_data_parallel_group()


def data_parallel_sum(t: torch.Tensor) -> torch.Tensor:
    """All-reduce (SUM, in place) over the data-parallel group; returns `t`."""
    group = _data_parallel_group()
    if group is not None:
        torch.distributed.all_reduce(t, group=group)
    return t


def data_parallel_max(t: torch.Tensor) -> torch.Tensor:
    """All-reduce (MAX, in place) over the data-parallel group; returns `t`."""
    group = _data_parallel_group()
    if group is not None:
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
    return t


def data_parallel_min(value: int) -> int:
    """The smallest `value` over the data-parallel ranks."""
    t = torch.tensor([value], dtype=torch.long, device=distributed.device())
    group = _data_parallel_group()
    if group is not None:
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=group)
    return int(t.item())


def data_parallel_gather_rows(t: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Every DP rank's rows of `t` [B_r, ...] (one trailing shape on every rank), concatenated
    in rank order on every rank, and the B_r of each rank."""
    group = _data_parallel_group()
    if group is None:
        return t, [len(t)]
    n = torch.distributed.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.long, device=t.device) for _ in range(n)]
    torch.distributed.all_gather(sizes, torch.tensor([len(t)], device=t.device), group=group)
    counts = [int(s) for s in sizes]
    padded = torch.zeros((max(counts), *t.shape[1:]), dtype=t.dtype, device=t.device)
    padded[: len(t)] = t
    parts = [torch.empty_like(padded) for _ in range(n)]
    torch.distributed.all_gather(parts, padded, group=group)
    return torch.cat([p[:c] for p, c in zip(parts, counts, strict=True)]), counts


def balance_over_data_parallel(batch: TrainingBatch) -> tuple[TrainingBatch, dict[str, float]]:
    """Re-deal the rows of the DP-global batch so each rank keeps its number of rows and the
    ranks' token sums are balanced (`balanced_assignment`); losses are unchanged (they are
    normalised over the DP-global batch). Every rank gathers the whole batch: simple, and
    small next to the rollout that made it. Returns this rank's rows and the largest rank's
    tokens over the mean, before and after."""
    group = _data_parallel_group()
    if group is None:
        return batch, {}
    device = batch.input_ids.device
    length = int(data_parallel_max(torch.tensor([batch.seq_length], device=device)))
    batch = batch.with_length(length)
    fields, counts = {}, []
    for name, value in vars(batch).items():
        if value is not None:
            fields[name], counts = data_parallel_gather_rows(value)
    everything = TrainingBatch(**fields)
    lengths = everything.sequence_lengths().tolist()
    ranks = balanced_assignment(lengths, counts)
    before, start = [], 0
    for c in counts:
        before.append(sum(lengths[start : start + c]))
        start += c
    after = [sum(lengths[i] for i in rows) for rows in ranks]
    mean = sum(lengths) / len(counts)
    mine = ranks[torch.distributed.get_rank(group)]
    metrics = {
        "perf/dp_tokens_max_over_mean_before": max(before) / mean,
        "perf/dp_tokens_max_over_mean": max(after) / mean,
    }
    return everything.rows(torch.tensor(mine, device=device)), metrics


def global_token_counts(response_mask: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor:
    """[3] float64, the same on every DP rank: valid tokens, non-empty sequences and
    positive-sample tokens of the DP-global batch, what token-level losses divide by.

    response_mask: [B, S] this rank's rows; scores: [B] outcome rewards or None."""
    positive = torch.zeros((), dtype=torch.float64, device=response_mask.device)
    if scores is not None:
        positive = (response_mask.bool() & (scores > 0)[:, None]).sum().double()
    return data_parallel_sum(torch.cat([token_and_sequence_counts(response_mask), positive[None]]))


def data_parallel_moments(m: Moments) -> Moments:
    """Count, sum and sum of squares over every DP rank's rows (global whitening)."""
    return Moments.from_tensor(data_parallel_sum(m.as_tensor()))


def data_parallel_explained_variance(
    values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor
) -> float:
    """Explained variance of the critic's values [B, S] for the returns [B, S] over every
    response token of the DP-global batch (the values before this step's update, as verl's
    vf_explained_var): one statistic, not a mean of per-rank or per-micro-batch ones."""
    return explained_variance_of(
        data_parallel_moments(Moments.of(returns, response_mask)),
        data_parallel_moments(Moments.of(returns - values, response_mask)),
    ).item()


def reduce_over_ranks(metrics: dict[str, float]) -> dict[str, float]:
    """Mean of each key over the ranks that report it (`*_max`: the max, `*_min`: the min;
    PP stages report different keys, TP ranks the same values). Every rank gets the result."""

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return dict(metrics)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, metrics)
    return combine_metrics(gathered)


def combine_metrics(reports: list[dict[str, float]]) -> dict[str, float]:
    """One dict from several: each key's mean over the reports that have it (`*_max`: the
    max, `*_min`: the min), keys sorted."""
    out = {}
    for key in sorted({k for m in reports for k in m}):
        values = [float(m[key]) for m in reports if key in m]
        if key.endswith("_max"):
            out[key] = max(values)
        elif key.endswith("_min"):
            out[key] = min(values)
        else:
            out[key] = sum(values) / len(values)
    return out


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is true on any rank of the world."""
    t = torch.tensor([1.0 if flag else 0.0], device=distributed.device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item())


def any_model_parallel_rank(flag: bool) -> bool:
    """True on every rank of this rank's tensor x pipeline group when `flag` is true on any
    of them (the ranks that run one rollout in lockstep)."""
    group = _model_parallel_group()
    if group is None:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=distributed.device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
    return bool(t.item())


def _model_parallel_group():
    """This rank's tensor x pipeline group, or None when it has one rank (or no world)."""
    # why: megatron-core takes seconds to import: loaded on first use
    from megatron.core import parallel_state

    if not dist.is_initialized() or not parallel_state.model_parallel_is_initialized():
        return None
    group = parallel_state.get_model_parallel_group()
    return None if torch.distributed.get_world_size(group) == 1 else group


def is_model_parallel_source() -> bool:
    """True on the one rank of each model-parallel (TP x PP) group that does the work whose
    result the group shares (scoring rewards), and everywhere without model parallelism."""
    group = _model_parallel_group()
    return group is None or torch.distributed.get_rank(group) == 0


def gather_over_model_parallel(obj) -> list:
    """`obj` of every rank of this rank's model-parallel group, in group-rank order, on every
    rank of the group (picklable objects; `[obj]` without model parallelism)."""
    group = _model_parallel_group()
    if group is None:
        return [obj]
    out = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(out, obj, group=group)
    return out


def broadcast_over_model_parallel(obj):
    """`obj` of the model-parallel group's source rank, returned on every rank of the group
    (a picklable object; what the other ranks pass is ignored)."""
    group = _model_parallel_group()
    if group is None:
        return obj
    box = [obj]
    src = torch.distributed.get_global_rank(group, 0)
    torch.distributed.broadcast_object_list(box, src=src, group=group)
    return box[0]
