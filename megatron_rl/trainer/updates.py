"""What the PPO and the value-pretraining updates share: the loop over mini-batches with its
abort points, the NaN/Inf streak guard and the mean of per-update metric records."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from megatron_rl.data.batch import TrainingBatch
from megatron_rl.parallel.collectives import balance_over_data_parallel
from megatron_rl.preemption import StepAborted


@dataclass(frozen=True)
class UpdateControl:
    """What an update loop needs of the run besides its roles and data."""

    abort_point: Callable[[str], None]
    """Raises `StepAborted(phase)` on every rank when some rank saw a stop request (a world
    collective: every rank reaches each call)."""
    rewindable: bool
    """`trainer.rewindable_update`: a stop between mini-batches rewinds the step's updates."""
    verbose: bool
    """This rank says what it does (rank 0)."""


@dataclass(frozen=True)
class MiniBatchPlan:
    """How one step's batch is cut for the updates on this data-parallel rank."""

    per_rank: int
    """Sequences of a mini-batch on this rank (`actor.ppo_mini_batch_size` / DP)."""
    micro_batches: int
    """Micro-batches per mini-batch (without a token budget)."""
    generator: torch.Generator
    """Shuffles the mini-batches (seeded by stage and step: a redone step draws the same)."""
    balance: bool
    """Whether the batch is balanced over DP ranks by tokens first (`trainer.balance_batch`)."""


def balanced(batch: TrainingBatch, plan: MiniBatchPlan) -> tuple[TrainingBatch, dict[str, float]]:
    """The batch balanced over DP ranks when the plan says so, and the balance's metrics."""
    return balance_over_data_parallel(batch) if plan.balance else (batch, {})


def optimizer_steps(
    roles: list, mini_batches: Iterable, count: int, control: UpdateControl
) -> tuple[list[list[dict]], dict[str, float]]:
    """Each of the `count` mini-batches' gradients for every role, then each role's optimizer
    step. `roles`: (role, loss config, micro-batching kwargs) per trained role; returns each
    role's update records, and the rewind copy's cost (`timing/rewind_snapshot_s`,
    `memory/rewind_snapshot_gib`; {} when none was taken).

    Stop requests: the abort point after the first mini-batch's gradients comes before
    any weight changed. With `trainer.rewindable_update` and several mini-batches, every role
    copies its update state to host memory right after it (`TrainableRole.snapshot_updates`)
    and each later mini-batch has an abort point before its gradients; an abort there rewinds
    every role to that copy, the step's start, before the trainer saves. The abort points
    are world collectives: every rank runs as many mini-batches."""
    records = [[] for _ in roles]
    rewindable = control.rewindable and count > 1
    metrics = {}
    for i, mb in enumerate(mini_batches):
        if i and rewindable:
            try:
                control.abort_point("train/mini_batch")
            except StepAborted:
                if control.verbose:
                    print(f"rewinding the step's {i} optimizer update(s)", flush=True)
                for role, _, _ in roles:
                    role.rewind_updates()
                raise
        gradients = [role.compute_gradients(mb, cfg, **split) for role, cfg, split in roles]
        if i == 0:
            control.abort_point("train/optimizer_step")  # nothing has changed yet
            if rewindable:
                start = time.perf_counter()
                for role, _, _ in roles:
                    role.snapshot_updates()
                held = sum(role.update_snapshot.nbytes for role, _, _ in roles)
                metrics = {
                    "timing/rewind_snapshot_s": time.perf_counter() - start,
                    "memory/rewind_snapshot_gib": held / 2**30,
                }
        for (role, _, _), g, out in zip(roles, gradients, records, strict=True):
            out.append(role.apply_gradients(g))
    return records, metrics


class NonFiniteUpdates(RuntimeError):
    pass


def nonfinite_streak(streak: int, records: list[dict], limit: int) -> int:
    """Steps in a row whose updates were skipped for NaN/Inf, after this step's update
    `records`; raises NonFiniteUpdates when it reaches `limit` (trainer.max_nonfinite_in_a_row)."""
    skipped = any(r.get("skipped_nonfinite", 0.0) for r in records)
    streak = streak + 1 if skipped else 0
    if streak >= limit:
        raise NonFiniteUpdates(
            f"{streak} steps in a row had NaN/Inf loss or gradients "
            f"(trainer.max_nonfinite_in_a_row={limit}); stopping"
        )
    return streak


def mean_metrics(records: list[dict], prefix: str = "") -> dict[str, float]:
    """Each key's mean over the records that have it, named `prefix + key` (a role's updates
    report under the role's namespace: `actor/`, `critic/`)."""
    keys = {k for r in records for k in r}
    out = {}
    for k in sorted(keys):
        values = [float(r[k]) for r in records if k in r]
        out[prefix + k] = sum(values) / len(values)
    return out
