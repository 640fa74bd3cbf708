"""Weighted sum of several reward functions over a batch, with failures contained and counted."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from megatron_rl.rewards.base import RewardInput
from megatron_rl.rewards.config import RewardFnConfig
from megatron_rl.rewards.isolated import IsolatedRewardFunction


class RewardFailureError(RuntimeError):
    """More reward calls failed than `max_failure_ratio` allows."""


@dataclass
class ScoredBatch:
    rewards: list[float]
    """Final reward of each sample: sum of weight * score (failure_reward where it failed)."""
    scores: dict[str, list[float]]
    """Each function's own score per sample; NaN where it failed."""
    errors: dict[str, list[str | None]] = field(default_factory=dict)

    def num_failures(self) -> dict[str, int]:
        return {name: sum(e is not None for e in errs) for name, errs in self.errors.items()}


class RewardScorer:
    """Builds the configured functions once (a reward model loads here) and scores batches."""

    def __init__(self, configs: Sequence[RewardFnConfig]):
        if not configs:
            raise ValueError("reward_fns: at least one reward function is needed")
        names = [c.display_name for c in configs]
        if len(set(names)) != len(names):
            raise ValueError(f"reward_fns: names must be unique, got {names} (set name:)")

        self.configs = list(configs)
        self.functions = []
        try:
            for c in configs:
                killable = c.killable and c.timeout_s is not None
                self.functions.append(IsolatedRewardFunction(c) if killable else c.build())
        except BaseException:
            self.close()
            raise

    def __call__(self, batch: list[RewardInput]) -> ScoredBatch:
        rewards = [0.0] * len(batch)
        scores, errors = {}, {}
        for config, fn in zip(self.configs, self.functions, strict=True):
            values, errs = fn(batch)
            scores[fn.name], errors[fn.name] = values, errs
            for i, v in enumerate(values):
                rewards[i] += config.weight * (config.failure_reward if math.isnan(v) else v)
        return ScoredBatch(rewards, scores, errors)

    def close(self) -> None:
        for fn in self.functions:
            fn.close()


def check_failure_ratio(
    batches: Sequence[ScoredBatch], max_failure_ratio: float
) -> dict[str, float]:
    """Failure metrics over `batches`; raises RewardFailureError naming the worst function and
    its first error when its failure ratio exceeds `max_failure_ratio`."""
    metrics: dict[str, float] = {}
    worst = None
    for name in batches[0].scores if batches else ():
        errs = [e for b in batches for e in b.errors[name]]
        failed = [e for e in errs if e is not None]
        ratio = len(failed) / max(len(errs), 1)
        metrics[f"rollout/reward/{name}/failures"] = float(len(failed))
        metrics[f"rollout/reward/{name}/failure_ratio"] = ratio
        if failed and (worst is None or ratio > worst[1]):
            worst = (name, ratio, len(failed), len(errs), failed[0])
    if worst is not None and worst[1] > max_failure_ratio:
        name, ratio, n_failed, n, first = worst
        raise RewardFailureError(
            f"reward function {name!r} failed on {n_failed}/{n} samples ({ratio:.0%} > "
            f"max_failure_ratio {max_failure_ratio:.0%}); first error: {first}"
        )
    return metrics
