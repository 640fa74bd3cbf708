"""A forward-only role on a TP / PP layout of its own, within the job's world: on-policy
distillation's teacher, larger than the student, sharded wider (NeMo-RL's teacher takes its
own `megatron_cfg` the same way).

The role's model is built, loaded and run with its own Megatron groups active
(`parallel/layout_groups.py`). A batch crosses layouts as rows: every rank gathers the job's
DP-global batch (token ids and response mask: all a log-prob needs), each of the role's DP
ranks takes a share balanced in tokens, the role's DP ranks gather the results, and every
rank keeps the rows it came with. Only copies cross between the layouts: the log-probs
are the role's forward on its own layout, equal to its forward on the job's up to the
rounding of another split of the sums.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch

from megatron_rl.data.batch import TrainingBatch, balanced_assignment, forward_microbatches
from megatron_rl.parallel.collectives import (
    data_parallel_gather_rows,
    data_parallel_max,
    data_parallel_min,
)
from megatron_rl.parallel.layout_groups import LayoutGroups


def _data_parallel_rank() -> int:
    from megatron.core import parallel_state  # why: megatron-core loads late

    return parallel_state.get_data_parallel_rank()


class OnOwnLayout:
    """`build()`'s role (a `ReferencePolicy`) on `groups`; the rest of the trainer sees a
    role with the reference's interface: `compute_logprobs` of the rows this rank holds,
    and the parameter offload between uses."""

    routing_metrics: dict[str, float] = {}

    def __init__(self, build: Callable[[], object], groups: LayoutGroups):
        self.groups = groups
        with groups.active():
            self.role = build()
        self.arch, self.layout = self.role.arch, groups.layout

    @property
    def device(self) -> torch.device:
        return self.role.device

    @property
    def offloaded_param_bytes(self) -> int:
        return self.role.offloaded_param_bytes

    def offload_params(self) -> None:
        self.role.offload_params()

    @contextlib.contextmanager
    def weights(self) -> Iterator[object]:
        """The role itself, its groups active: for what reads its weights through megatron's
        group getters, the weight push of `teacher.evaluate` (its TP shards gathered and its
        PP stages broadcast on its own layout, so every rank holds whole tensors)."""
        with self.groups.active():
            yield self.role

    def restore_params(self) -> None:
        self.role.restore_params()

    def compute_logprobs(
        self, batch: TrainingBatch, num_microbatches: int = 1, max_tokens: int | None = None
    ) -> torch.Tensor:
        """Log-probs [B, S] of this rank's rows of the job's batch, as the role gives them on
        its layout. Collective over the world. `num_microbatches` is the job's for these
        rows: the role's share runs in micro-batches of the same size."""
        rows, length = len(batch), batch.seq_length
        longest = int(data_parallel_max(torch.tensor([length], device=batch.input_ids.device)))
        padded = batch.with_length(longest)
        ids, counts = data_parallel_gather_rows(padded.input_ids)
        mask, _ = data_parallel_gather_rows(padded.response_mask)
        whole = TrainingBatch(input_ids=ids, response_mask=mask)
        start = sum(counts[: _data_parallel_rank()])
        # one micro-batch size on every rank (the role's TP / PP ranks run one schedule)
        per_micro_batch = data_parallel_min(math.ceil(rows / num_microbatches))
        with self.groups.active():
            dp = self.layout.data_parallel_size(torch.distributed.get_world_size())
            if len(whole) < dp:
                raise ValueError(
                    f"a batch of {len(whole)} rows cannot be shared by the {dp} data-parallel "
                    f"ranks of the layout {self.layout}"
                )
            sizes = [len(whole) // dp + (r < len(whole) % dp) for r in range(dp)]
            shares = balanced_assignment(whole.sequence_lengths().tolist(), sizes)
            mine = whole.rows(torch.tensor(shares[_data_parallel_rank()], device=ids.device))
            count = forward_microbatches(len(mine), per_micro_batch)
            logprobs, _ = data_parallel_gather_rows(
                self.role.compute_logprobs(mine, count, max_tokens)
            )
        order = torch.tensor([i for share in shares for i in share], device=logprobs.device)
        in_batch_order = torch.empty_like(logprobs)
        in_batch_order[order] = logprobs
        return in_batch_order[start : start + rows, :length]
