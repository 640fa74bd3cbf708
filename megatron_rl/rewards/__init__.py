"""Rewards: rule verifiers, reward models with their own templates, remote services, user
functions by import path; a scorer that sums them and contains failures; inline or Ray pools."""

from megatron_rl.rewards.base import RewardFunction, RewardInput
from megatron_rl.rewards.config import (
    MathRewardConfig,
    PythonRewardConfig,
    RemoteRewardConfig,
    RewardFnConfig,
    RewardModelConfig,
    reward_fn_config,
)
from megatron_rl.rewards.pool import ScoringPoolConfig, make_scoring_pool
from megatron_rl.rewards.scorer import RewardFailureError, RewardScorer, ScoredBatch

__all__ = [
    "MathRewardConfig",
    "PythonRewardConfig",
    "RemoteRewardConfig",
    "RewardFailureError",
    "RewardFnConfig",
    "RewardFunction",
    "RewardInput",
    "RewardModelConfig",
    "RewardScorer",
    "ScoredBatch",
    "ScoringPoolConfig",
    "make_scoring_pool",
    "reward_fn_config",
]
