"""What the PPO and the value-pretraining updates share: the NaN/Inf streak guard and the mean
of per-update metric records."""

from __future__ import annotations


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
