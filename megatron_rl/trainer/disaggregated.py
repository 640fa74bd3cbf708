"""The two roles of a disaggregated placement talking (#45; docs/design/async.md §3): the
trainers' side (`EngineRanks`) and what passes between them and the engine ranks
(`trainer/engine_worker.py`). Synchronous (max_staleness 0): each step's rollout is made
with the weights of the step before, exactly as colocated.

Two groups span the roles, both made on the job's store (`parallel/placement.py`) with
trainer rank 0 as rank 0 and engine rank e as rank 1 + e: the *stream* (gloo always: commands
and rated samples are host objects; no device sync for control) and the *bridge* (NCCL on
GPU: the actor's tensors, `sync/weight_push.py`).

One step, k = 0:

    trainer rank 0                              engine rank e (one of E replicas)
    Generate(stage, step, data position) -----> its share: rollout_batch_size / E prompts
                                                 drawn from that position, rated
                                                 (`rounds.generate_round`, as colocated)
    <------------------------------------------- Rated(e, groups, metrics, position, aborted)
    groups dealt to the trainers' DP ranks; experience; PPO update
    Weights(version) and the tensors (bridge) --> checked, reloaded in place
    ...
    Shutdown ----------------------------------> exits

A stop request reaches both roles through the job's store: an engine aborts its share within
a few engine steps and answers `aborted`, the trainers abort the step as colocated (its start
is saved) and `close` sends Shutdown. Engines hold no state a resume needs: the data position
travels with each Generate and comes back advanced, so checkpoints are the colocated ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rl.parallel.collectives import combine_metrics
from megatron_rl.parallel.placement import Placement
from megatron_rl.sync.weight_push import (
    bridge_group,
    broadcast_object,
    push_weights,
    recv_object,
)
from megatron_rl.sync.weight_sync import WeightSyncConfig, all_stage_tensors


@dataclass(frozen=True)
class Generate:
    """Rate your share of `stage` step `step`'s prompts, drawn from position `data`."""

    stage: str
    step: int
    data: dict


@dataclass(frozen=True)
class Weights:
    """The actor's tensors as policy `version` follow on the bridge."""

    version: int


@dataclass(frozen=True)
class Evaluate:
    """Sample and score your share of every eval set at PPO step `step`; answer each set's
    sums (`Evaluator.local_sums`)."""

    step: int


@dataclass(frozen=True)
class Shutdown:
    """The run is over (or stopped and saved): leave."""


@dataclass
class Rated:
    """An engine replica's answer to `Generate`."""

    replica: int
    groups: list
    metrics: dict[str, float]
    data: dict
    """The prompt stream's position after this replica's draws."""
    aborted: str | None = None
    """The phase a stop request aborted the rollout in (then no groups)."""


def cross_role_groups(placement: Placement, store, rank: int):
    """(stream, bridge) on trainer rank 0 and the engine ranks, (None, None) on the other
    trainers. Every member calls it at start-up, in this order (a group's creation waits for
    all its members)."""
    member = placement.bridge_rank(rank)
    if member is None:
        return None, None
    size = placement.bridge_size
    stream = bridge_group(store, member, size, "stream", backend="gloo")
    return stream, bridge_group(store, member, size, "bridge")


def furthest(positions: list[dict]) -> dict:
    """The prompt-stream position furthest on: replicas that drew a different number of
    chunks (dynamic filtering) never hand a drawn prompt to a later step."""
    return max(positions, key=lambda p: (p["epoch"], p["index"]))


def deal(results: list[Rated], dp_size: int) -> tuple[list[list], dict, dict, str | None]:
    """Replicas' answers -> (groups of each trainer DP rank, rollout metrics, the data
    position, the aborting phase or None). Groups are taken in replica order and cut into
    `dp_size` equal contiguous slices (a remainder is dropped, as colocated trims every DP
    rank to the shortest); metrics are averaged over replicas (`*_max` / `*_min` kept)."""
    results = sorted(results, key=lambda r: r.replica)
    aborted = next((r.aborted for r in results if r.aborted), None)
    groups = [g for r in results for g in r.groups]
    per_rank = len(groups) // dp_size
    shares = [groups[d * per_rank : (d + 1) * per_rank] for d in range(dp_size)]
    metrics = combine_metrics([r.metrics for r in results if r.metrics])
    return shares, metrics, furthest([r.data for r in results]), aborted


class EngineRanks:
    """The engine ranks, seen from the trainers: every trainer rank calls each method at the
    same point (the trainers' default group carries the results from trainer rank 0)."""

    def __init__(self, placement: Placement, store, ctx):
        self.placement, self.ctx = placement, ctx
        self.stream, self.bridge = cross_role_groups(placement, store, ctx.rank)
        # which DP rank each trainer rank is, for dealing the groups
        dp_ranks = [None] * ctx.world_size
        torch.distributed.all_gather_object(dp_ranks, ctx.dp_rank)
        self.dp_ranks = dp_ranks
        self.bucket_bytes = int(WeightSyncConfig().bucket_mb * 2**20)

    @property
    def is_source(self) -> bool:
        return self.stream is not None

    def generate(self, stage: str, step: int, data: dict):
        """(this rank's DP share of the rated groups, rollout metrics, data position after
        the draws, the aborting phase or None) of `stage` step `step` from position `data`."""
        answers = None
        if self.is_source:
            broadcast_object(self.stream, Generate(stage, step, data), root=0)
            results = [
                recv_object(self.stream, src=1 + e) for e in range(self.placement.engine_ranks)
            ]
            shares, metrics, position, aborted = deal(results, self.ctx.dp_size)
            answers = [(shares[d], metrics, position, aborted) for d in self.dp_ranks]
        mine = [None]
        torch.distributed.scatter_object_list(mine, answers, src=0)
        return mine[0]

    def evaluate(self, step: int) -> list[torch.Tensor]:
        """Each eval set's sums over all its prompts at PPO step `step`, on every trainer
        rank: each engine replica evaluates its slice (`Evaluator.local_sums`)."""
        total = None
        if self.is_source:
            broadcast_object(self.stream, Evaluate(step), root=0)
            answers = [
                recv_object(self.stream, src=1 + e) for e in range(self.placement.engine_ranks)
            ]
            total = [sum(sets) for sets in zip(*answers, strict=True)]
        shared = [total]
        torch.distributed.broadcast_object_list(shared, src=0)
        return shared[0]

    def push(self, actor, version: int) -> dict[str, float]:
        """The actor's weights to every engine as policy `version` (every trainer rank: the
        first replica's ranks export, TP-gathered and PP stage by stage; rank 0 sends)."""
        if self.ctx.dp_rank != 0:
            return {}
        tensors = all_stage_tensors(actor.chunks, actor.arch, self.bucket_bytes)
        if not self.is_source:
            for _ in tensors:  # the export's collectives in this rank's TP and PP groups
                pass
            return {}
        broadcast_object(self.stream, Weights(version), root=0)
        return push_weights(self.bridge, tensors, version, self.bucket_bytes)

    def shutdown(self) -> None:
        if self.is_source:
            broadcast_object(self.stream, Shutdown(), root=0)
            self.stream = self.bridge = None
