"""KL divergence to the reference policy, per token, and its two placements.

Estimators of KL(pi || pi_ref) from samples of pi, with log_ratio = log pi - log pi_ref
(J. Schulman, "Approximating KL Divergence", 2020):
- k1 = log_ratio                          unbiased, high variance, can be negative;
- k2 = 0.5 * log_ratio^2                  biased, low variance (REINFORCE++ with baseline);
- k3 = exp(-log_ratio) - 1 + log_ratio    unbiased, >= 0 (GRPO, DeepSeekMath 2402.03300).

Placement: in the reward (PPO, REINFORCE++: `kl_penalized_token_rewards`) or in the loss
(GRPO: aggregate the per-token KL with `losses.aggregate_loss` and add beta times it).
With beta = 0 the caller skips the reference model entirely; nothing here is computed.
"""

from __future__ import annotations

from typing import Literal

import torch

from megatron_rl.algorithms.checks import check_mask, check_same_shape

KLEstimator = Literal["k1", "k2", "k3"]

LOG_RATIO_CLAMP = 20.0
"""|log pi - log pi_ref| is clamped here before k3's exp, so one wild token cannot overflow."""


def kl_estimate(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator = "k3"
) -> torch.Tensor:
    """Per-token KL estimate [B, T] from log-probs [B, T] of the sampled tokens."""
    check_same_shape("ref_logprobs", ref_logprobs, "logprobs", logprobs)
    log_ratio = (logprobs - ref_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"kl estimator {estimator!r} is not one of 'k1', 'k2', 'k3'")


def outcome_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each response's scalar reward [B] on its last valid token: [B, T].

    Rows with an empty mask get no reward.
    """
    check_mask(response_mask)
    b, t = response_mask.shape
    mask = response_mask.bool()
    positions = torch.arange(t, device=mask.device).expand(b, t)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).amax(dim=1)
    rewards = torch.zeros(b, t, dtype=scores.dtype, device=scores.device)
    has_tokens = last >= 0
    rows = torch.arange(b, device=mask.device)[has_tokens]
    rewards[rows, last[has_tokens]] = scores[has_tokens]
    return rewards


def kl_penalized_token_rewards(
    scores: torch.Tensor, token_kl: torch.Tensor, response_mask: torch.Tensor, kl_coef: float
) -> torch.Tensor:
    """r_t = [t is last] * score - beta * KL_t on valid tokens, 0 on padding: [B, T]."""
    check_same_shape("token_kl", token_kl, "response_mask", response_mask)
    rewards = outcome_token_rewards(scores, response_mask)
    penalty = torch.where(response_mask.bool(), token_kl, torch.zeros_like(token_kl))
    return rewards - kl_coef * penalty.to(rewards.dtype)
