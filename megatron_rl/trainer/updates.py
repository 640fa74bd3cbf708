"""What the PPO and the value-pretraining updates share: the loop over mini-batches with its
abort points, the NaN/Inf streak guard and the mean of per-update metric records."""

from __future__ import annotations

import time
from collections.abc import Iterable

from megatron_rl.preemption import StepAborted


def optimizer_steps(
    trainer, roles: list, mini_batches: Iterable, count: int
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
    rewindable = trainer.config.trainer.rewindable_update and count > 1
    metrics = {}
    for i, mb in enumerate(mini_batches):
        if i and rewindable:
            try:
                trainer.abort_point("train/mini_batch")
            except StepAborted:
                if trainer.ctx.rank == 0:
                    print(f"rewinding the step's {i} optimizer update(s)", flush=True)
                for role, _, _ in roles:
                    role.rewind_updates()
                raise
        gradients = [role.compute_gradients(mb, cfg, **split) for role, cfg, split in roles]
        if i == 0:
            trainer.abort_point("train/optimizer_step")  # nothing has changed yet
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
