"""The two roles of a disaggregated placement talking (docs/design/async.md §3): the
trainers' side (`EngineRanks`) and what passes between them and the engine ranks
(`rollout/service/engine_worker.py`).

Two groups span the roles, both made on the job's store (`parallel/placement.py`) with
trainer rank 0 as rank 0 and engine rank e as rank 1 + e: the *stream* (gloo always: commands
and rated samples are host objects; no device sync for control) and the *bridge* (NCCL on
GPU: the actor's tensors, `sync/weight_push.py`).

PPO steps, k = async.max_staleness:

    trainer rank 0                              engine rank e (one of E replicas)
    Rounds(step, end, data position, k) ------>  for r in step..end-1: wait (reading
                                                 commands) until it holds version >= r - k;
                                                 rate its share of step r's prompts
                                                 (`rounds.generate_round`, as colocated)
    <------------------------------------------- Rated(e, groups, ..., round r, version)
    groups dealt to the trainers' DP ranks; experience; PPO update
    Weights(r + 1[, evaluate]) and the tensors --> checked, reloaded in place[, eval sums]
    ...
    Shutdown ----------------------------------> exits

At k = 0 step r's rollout is made with the weights step r trains: the colocated run, exactly.
At k = 1 the engine makes step r + 1's while step r trains (one-step-off).

Every command is one ring of the *doorbell* (a counter in the job's store, DOORBELL_KEY) and
one `Ready` from each replica: an engine sends `Ready` on the stream just before it reads a
command, and the trainers, having rung, receive from each replica until its `Ready` (keeping
the `Rated` answers that come first) before they send the command, so no command waits on
an engine that waits on the trainers, whatever the timing. An engine posts its answers
without waiting for them to be received (`post_object`: a gloo send would wait), so it runs
as many rounds ahead as the admission rule allows.
An engine reads a command when it must wait for a version; with `async.partial_rollout` also
as soon as it sees the bell (between rounds, and inside a round every few engine steps: the
round then goes on under the new weights, `VLLMEngine.generate(refresh=...)`), which is what
lets k >= 2 run without a push waiting for rounds ahead. Value pretraining (policy frozen)
asks for one round at a time (`Generate`); evaluations ride on a push (or `Evaluate`).

A stop request reaches both roles through the job's store: an engine aborts its round within
a few engine steps and answers `aborted` with what it generated (`Rated.progress`), the
trainers abort the step as colocated (its start is saved, with the step's round as far as it
got) and `close` receives what is due, then sends Shutdown. The data position the
checkpoint keeps is the trainers' (each answer brings back where its draws ended); the kept
round goes back to the engines with the first command after the resume (`saved`), and what
was generated ahead of the aborted step is generated again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_rl.parallel.collectives import combine_metrics
from megatron_rl.parallel.placement import Placement
from megatron_rl.rollout.progress import RolloutProgress
from megatron_rl.sync.weight_push import (
    bridge_group,
    broadcast_object,
    push_weights,
    recv_object,
)
from megatron_rl.sync.weight_sync import WeightSyncConfig, all_stage_tensors


@dataclass(frozen=True)
class Generate:
    """Rate your share of `stage` step `step`'s prompts, drawn from position `data`;
    `saved`: the step's progress a stop's checkpoint kept, by replica."""

    stage: str
    step: int
    data: dict
    saved: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Rounds:
    """Generate PPO steps `step`..`end - 1`, round after round, from data position `data`:
    round r starts once you hold a version >= r - `max_staleness`; answer each (`Rated`);
    read commands while waiting for a version, after the last round or an aborted one, and
    (partial rollouts) whenever the doorbell rang."""

    step: int
    end: int
    data: dict
    max_staleness: int
    saved: dict = field(default_factory=dict)
    """Step `step`'s progress a stop's checkpoint kept, by replica."""


@dataclass(frozen=True)
class Weights:
    """The actor's tensors as policy `version` follow on the bridge; with `evaluate_step`,
    evaluate with them at once and answer the sums."""

    version: int
    evaluate_step: int | None = None


@dataclass(frozen=True)
class Evaluate:
    """Sample and score your share of every eval set at PPO step `step`; answer each set's
    sums (`Evaluator.local_sums`)."""

    step: int


@dataclass(frozen=True)
class Ready:
    """An engine replica's first rank is about to read a command."""

    replica: int


DOORBELL_KEY = "megatron_rl/doorbell"
"""The job-store counter trainer rank 0 adds 1 to before each command: an engine that has
read fewer commands than it counts has one waiting."""


@dataclass(frozen=True)
class Shutdown:
    """The run is over (or stopped and saved): leave."""


@dataclass
class Rated:
    """An engine replica's answer to `Generate`, or to one round of `Rounds`."""

    replica: int
    groups: list
    metrics: dict[str, float]
    data: dict
    """The prompt stream's position after this replica's draws."""
    aborted: str | None = None
    """The phase a stop request aborted the rollout in (then no groups)."""
    round: int = 0
    """The step it is the rollout of."""
    version: int = 0
    """The policy version that generated it (with partial rollouts: the one its responses
    started under; later tokens may come from newer ones, `Sample.segments`)."""
    progress: RolloutProgress | None = None
    """Everything it generated, aborted or not (trainer rank 0 keeps it with the checkpoint
    when a stop ends the step); shares the groups' samples, so it adds nothing on the wire."""


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
    same point (the trainers' default group carries the results from trainer rank 0, the
    only one talking to the engines)."""

    def __init__(
        self, placement: Placement, store, ctx, max_staleness: int = 0, engine_tp: int = 1
    ):
        self.placement, self.ctx, self.max_staleness = placement, ctx, max_staleness
        self.engine_tp = engine_tp
        """Engine ranks per replica (vLLM TP); replica e answers from engine rank e x tp."""
        self.stream, self.bridge = cross_role_groups(placement, store, ctx.rank)
        # which DP rank each trainer rank is, for dealing the groups
        dp_ranks = [None] * ctx.world_size
        torch.distributed.all_gather_object(dp_ranks, ctx.dp_rank)
        self.dp_ranks = dp_ranks
        self.bucket_bytes = int(WeightSyncConfig().bucket_mb * 2**20)
        self.version = 0
        """The policy version the engines hold: what was pushed last (0: the starting
        weights, which the engines load themselves)."""
        self.store = store
        self.rounds_started = False
        self.pending: dict[int, list[Rated]] = {}
        """Answers received ahead of their step, by round."""

    @property
    def is_source(self) -> bool:
        return self.stream is not None

    @property
    def replicas(self) -> int:
        return self.placement.engine_ranks // self.engine_tp

    def _recv(self, replica: int):
        return recv_object(self.stream, src=1 + replica * self.engine_tp)

    def _share(self, results: list[Rated] | None):
        """Rank 0's answers dealt: (this rank's DP share of the groups, rollout metrics,
        the data position after the draws, the aborting phase or None, the version that
        generated them, every replica's progress on rank 0 and {} elsewhere)."""
        answers = None
        if self.is_source:
            shares, metrics, position, aborted = deal(results, self.ctx.dp_size)
            version = min(r.version for r in results)
            # the progress stays on rank 0, which writes it with a stop's checkpoint
            kept = {r.replica: r.progress for r in results if r.progress is not None}
            answers = [
                (shares[d], metrics, position, aborted, version, kept if rank == 0 else {})
                for rank, d in enumerate(self.dp_ranks)
            ]
        mine = [None]
        torch.distributed.scatter_object_list(mine, answers, src=0)
        return mine[0]

    def generate(self, stage: str, step: int, data: dict, saved: dict):
        """`stage` step `step`'s rollout from data position `data`, generated now with the
        weights the engines hold (synchronous: value pretraining, whose policy is frozen);
        returns as `_share`."""
        results = None
        if self.is_source:
            self._command(Generate(stage, step, data, saved))
            results = [self._recv(e) for e in range(self.replicas)]
        return self._share(results)

    def round(self, step: int, end: int, data: dict, saved: dict):
        """PPO step `step`'s rollout (returned as `_share`): the engines generate steps
        `step`..`end - 1` ahead as far as `max_staleness` allows, from data position `data`
        and with `saved` progress (used when this is the first round asked for)."""
        results = None
        if self.is_source:
            if not self.rounds_started:
                self._command(Rounds(step, end, data, self.max_staleness, saved))
                self.rounds_started = True
            for e in range(self.replicas):
                while e not in {r.replica for r in self.pending.get(step, [])}:
                    if self._receive(e):
                        raise RuntimeError(
                            f"round {step}: engine replica {e} waits for a command instead "
                            f"of answering it (engines hold version {self.version}, "
                            f"max_staleness {self.max_staleness}): a protocol bug"
                        )
            results = self.pending.pop(step)
        return self._share(results)

    def _receive(self, replica: int) -> bool:
        """One message from `replica`: True if it is `Ready`, else an answer kept by round."""
        answer = self._recv(replica)
        if isinstance(answer, Ready):
            return True
        self.pending.setdefault(answer.round, []).append(answer)
        return False

    def _command(self, command) -> None:
        """Ring, receive until every replica is Ready, send (the module's docstring)."""
        self.store.add(DOORBELL_KEY, 1)
        for e in range(self.replicas):
            while not self._receive(e):
                pass
        broadcast_object(self.stream, command, root=0)

    def evaluate(self, step: int) -> list[torch.Tensor]:
        """Each eval set's sums over all its prompts at PPO step `step`, on every trainer
        rank: each engine replica evaluates its slice (`Evaluator.local_sums`) with the
        weights it holds."""
        total = None
        if self.is_source:
            self._command(Evaluate(step))
            total = self._eval_sums()
        shared = [total]
        torch.distributed.broadcast_object_list(shared, src=0)
        return shared[0]

    def _eval_sums(self) -> list[torch.Tensor]:
        answers = [self._recv(e) for e in range(self.replicas)]
        return [sum(sets) for sets in zip(*answers, strict=True)]

    def push(self, actor, version: int, evaluate_step: int | None = None):
        """The actor's weights to every engine as policy `version` (every trainer rank: the
        first replica's ranks export, TP-gathered and PP stage by stage; rank 0 sends).
        With `evaluate_step`, the engines evaluate with them at once, before any further
        round: returns the sums as `evaluate` does (None otherwise)."""
        sums = None
        if self.ctx.dp_rank == 0:
            tensors = all_stage_tensors(actor.chunks, actor.arch, self.bucket_bytes)
            if self.is_source:
                self._command(Weights(version, evaluate_step))
                push_weights(self.bridge, tensors, version, self.bucket_bytes)
                if evaluate_step is not None:
                    sums = self._eval_sums()
            else:
                for _ in tensors:  # the export's collectives in this rank's TP and PP groups
                    pass
        self.version = version
        if evaluate_step is None:
            return None
        shared = [sums]
        torch.distributed.broadcast_object_list(shared, src=0)
        return shared[0]

    def shutdown(self) -> None:
        if self.is_source:
            self._command(Shutdown())
            self.stream = self.bridge = None
