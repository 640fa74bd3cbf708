"""Built-in reward functions: the math verifier and user functions by import path."""

from __future__ import annotations

from megatron_rl.plugins import load_callable
from megatron_rl.rewards.base import RewardFunction, RewardInput
from megatron_rl.rewards.math_reward import MathVerifierConfig, math_reward
from megatron_rl.rewards.math_symbolic import warm_up


class MathReward(RewardFunction):
    def __init__(self, name: str, config: MathVerifierConfig, timeout_s: float | None):
        super().__init__(name, timeout_s)
        self.config = config
        if config.backend == "math_verify":
            warm_up()

    def score_one(self, sample: RewardInput) -> float:
        return math_reward(sample.response, sample.label, self.config)


class PythonReward(RewardFunction):
    """A user function. Per sample (verl's `compute_score` shape):
        fn(prompt: str, response: str, label, **kwargs) -> float
    batched (OpenRLHF's `reward_func` shape):
        fn(prompts: list[str], responses: list[str], labels: list, **kwargs) -> list[float]
    `prompt` is the templated prompt text the actor saw."""

    def __init__(self, name: str, path: str, batched: bool, kwargs: dict, timeout_s: float | None):
        super().__init__(name, timeout_s)
        self.fn = load_callable(path)
        self.batched = batched
        self.kwargs = dict(kwargs)

    def score_one(self, sample: RewardInput) -> float:
        return self.fn(sample.prompt_text, sample.response, sample.label, **self.kwargs)

    def score_batch(self, batch: list[RewardInput]) -> list[float]:
        return self.fn(
            [s.prompt_text for s in batch],
            [s.response for s in batch],
            [s.label for s in batch],
            **self.kwargs,
        )
