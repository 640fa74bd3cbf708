"""Sampling strategies of `generate_samples_with_rating`: which rated groups enter a rollout.

A strategy sees each prompt's group of rated samples once (`keep`), then the kept groups once
(`finalize`). Write a new one by subclassing `SamplingStrategy` and naming it by import path
(`my_pkg.strategies:MyStrategy`) in the config; the trainer does not change.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from megatron_rl.plugins import load_callable


@dataclass
class RatedSample:
    prompt: Any
    """The `PromptRecord` it answers."""
    sample: Any
    """The engine's `Sample` (token ids, log-probs, finish reason)."""
    response: str
    reward: float
    scores: dict[str, float]
    """Each reward function's own score (NaN where it failed)."""


Group = list[RatedSample]


class SamplingStrategy:
    """Plain sampling: every group is kept; generation stops at exactly `rollout_size` prompts."""

    exact = True
    """Whether every generated group is kept, so the stage never generates more prompts than
    it needs. Filtering strategies set False and generate whole chunks."""

    def __init__(self, **options):
        if options:
            raise ValueError(
                f"strategy {type(self).__name__} takes no options, got {sorted(options)}"
            )

    def keep(self, group: Group) -> bool:
        return True

    def finalize(
        self, groups: list[Group], rollout_size: int
    ) -> tuple[list[Group], dict[str, float]]:
        return groups[:rollout_size], {}


class DynamicFiltering(SamplingStrategy):
    """DAPO's dynamic sampling (arXiv 2503.14476): drop groups whose rewards are all equal
    (all right or all wrong: zero advantage under a group baseline, no gradient) and keep
    sampling until the rollout is full or the chunk cap is reached."""

    exact = False

    def __init__(self, tolerance: float = 0.0):
        self.tolerance = tolerance

    def keep(self, group: Group) -> bool:
        rewards = [s.reward for s in group]
        return max(rewards) - min(rewards) > self.tolerance


class PositiveNegativeBalance(SamplingStrategy):
    """Balance positive (reward > threshold) and negative samples: keep every sample of the
    minority class and as many of the majority, drawn at random (seeded). Groups lose
    samples, so use it with per-sample estimators (gae, reinforce_plus_plus), not grpo/rloo.
    A rollout with no sample of one class is returned unbalanced (metric
    `balance/unbalanced`)."""

    def __init__(self, threshold: float = 0.0, seed: int = 0):
        self.threshold = threshold
        self.rng = random.Random(seed)

    def finalize(self, groups, rollout_size):
        groups = groups[:rollout_size]
        flat = [(g, i) for g, group in enumerate(groups) for i in range(len(group))]
        pos = [x for x in flat if groups[x[0]][x[1]].reward > self.threshold]
        neg = [x for x in flat if groups[x[0]][x[1]].reward <= self.threshold]
        if not pos or not neg:
            return groups, {"balance/unbalanced": 1.0, "balance/dropped_samples": 0.0}
        n = min(len(pos), len(neg))
        chosen = set(self.rng.sample(pos, n)) | set(self.rng.sample(neg, n))
        out = [
            [s for i, s in enumerate(group) if (g, i) in chosen] for g, group in enumerate(groups)
        ]
        metrics = {"balance/unbalanced": 0.0, "balance/dropped_samples": float(len(flat) - 2 * n)}
        return [group for group in out if group], metrics


STRATEGIES: dict[str, type[SamplingStrategy]] = {
    "plain": SamplingStrategy,
    "dynamic_filtering": DynamicFiltering,
    "balance": PositiveNegativeBalance,
}


def make_strategy(name: str, options: dict | None = None) -> SamplingStrategy:
    cls = STRATEGIES.get(name) or (
        load_callable(name, "sampling strategy") if ":" in name else None
    )
    if cls is None:
        raise ValueError(
            f"sampling strategy {name!r}: expected one of {sorted(STRATEGIES)} or "
            "'package.module:Class'"
        )
    try:
        return cls(**(options or {}))
    except TypeError as e:
        raise ValueError(f"sampling strategy {name!r}: bad options {options}: {e}") from e
