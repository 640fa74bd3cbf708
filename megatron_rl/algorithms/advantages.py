"""Advantage estimators: one signature, one registry.

    estimator = get_adv_estimator(config.estimator)
    out = estimator(AdvantageInputs(scores, response_mask, values=..., group_index=...), config)

Every estimator takes right-padded [B, T] tensors with a 0/1 response mask (holes in the
mask are skipped, as if those tokens were absent: a multi-turn rollout's environment tokens
are such holes) and returns `AdvantageOutputs`:
`advantages` for the policy loss and `returns` as the critic's targets (critic-free
estimators return their unwhitened advantages there, for logging).

Registered (paper in each docstring):
- "gae": PPO's GAE with VC-PPO/VAPO's decoupled lambdas and VAPO's length-adaptive lambda;
- "grpo": group-normalised outcome reward (DeepSeekMath);
- "rloo": leave-one-out baseline (RLOO);
- "reinforce_plus_plus": KL-penalised return-to-go, globally whitened (REINFORCE++);
- "reinforce_plus_plus_baseline": group-mean baseline, then global whitening (REINFORCE++);
- "on_policy_distill": none of the task reward's: the teacher's per-token signal alone
  (on-policy distillation, `algorithms/distill.py`).

Multi-turn rollouts: environment tokens are holes, so GAE bootstraps the last policy
token of turn k from V at the first policy token of turn k+1 (the state that has read the
environment's answer) with no discount or lambda decay across the block: one policy token is
one time step, the environment's answer part of the transition (verl's choice, "skip values
and TD-error on observation tokens", PR #2337; slime instead steps through them, OpenRLHF
zeroes their values). `step_rewards` (an environment's per-step rewards, on the policy token
that caused the step) add to the token rewards of GAE and REINFORCE++; the group estimators
(GRPO, RLOO, REINFORCE++ with baseline) rate a trajectory by its total, outcome plus steps.

Across data-parallel ranks: group estimators need each prompt's samples on one rank;
whitening needs global moments. Call the estimator, all-reduce `out.raw_moments()`, then
`out.rewhiten(Moments.from_tensor(reduced))`; with one rank, `out` is already final.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from megatron_rl.algorithms.checks import (
    check_finite,
    check_groups,
    check_mask,
    check_per_sequence,
    check_same_shape,
)
from megatron_rl.algorithms.kl import kl_penalized_token_rewards
from megatron_rl.algorithms.masked import Moments, masked_whiten
from megatron_rl.algorithms.registry import EstimatorTraits, lookup, registrar
from megatron_rl.algorithms.rollout_correction import RolloutCorrectionConfig


@dataclass(frozen=True)
class AdvantageConfig:
    """Hyper-parameters of every estimator (each reads the fields it needs)."""

    estimator: str = "gae"
    """A name registered with `register_adv_est`."""
    gamma: float = 1.0
    """Discount; 1.0 for LLM RL (VAPO, VC-PPO)."""
    lambda_policy: float = 0.95
    """GAE lambda of the policy's advantages (VC-PPO: 0.95); when length-adaptive, only for
    responses too short for the formula (alpha * l <= 1)."""
    lambda_critic: float = 1.0
    """GAE lambda of the critic's returns (VC-PPO/VAPO: 1.0, the unbiased Monte-Carlo return)."""
    length_adaptive_alpha: float | None = None
    """VAPO's length-adaptive lambda_policy = 1 - 1/(alpha * l) per sequence; 0.05 in the
    paper, for responses of hundreds to thousands of tokens. Choose alpha so that alpha * l
    is well above 1 for typical lengths l; where alpha * l <= 1 the formula gives no lambda
    in (0, 1) and lambda_policy is used instead. None keeps lambda_policy fixed."""
    kl_coef: float = 0.0
    """beta of the KL penalty folded into token rewards (used when token_kl is given)."""
    whiten_advantages: bool = True
    """GAE only: whiten the policy advantages over valid tokens (global with rewhiten)."""
    grpo_norm_by_std: bool = True
    """GRPO: divide by the group std (False gives Dr. GRPO's mean-only baseline)."""
    eps: float = 1e-6
    """Added to the group std in GRPO."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Importance weights / rejection for the rollout engine's policy differing from the
    trainer's (verl's `algorithm.rollout_correction`); read by the experience maker, not the
    estimators."""

    def __post_init__(self) -> None:
        for name in ("gamma", "lambda_policy", "lambda_critic"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if self.length_adaptive_alpha is not None and self.length_adaptive_alpha <= 0:
            raise ValueError(f"length_adaptive_alpha must be > 0, got {self.length_adaptive_alpha}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")


@dataclass(frozen=True)
class AdvantageInputs:
    """One batch of responses. Shapes: B responses, T response tokens (right-padded)."""

    scores: torch.Tensor
    """[B] outcome reward of each response (given at its last token)."""
    response_mask: torch.Tensor
    """[B, T] 1 on response tokens, 0 on padding."""
    values: torch.Tensor | None = None
    """[B, T] critic values V(s_t) of response tokens (GAE only)."""
    group_index: torch.Tensor | None = None
    """[B] prompt id of each response; samples of one prompt share it (group estimators)."""
    token_kl: torch.Tensor | None = None
    """[B, T] per-token KL to the reference, folded into rewards with config.kl_coef."""
    step_rewards: torch.Tensor | None = None
    """[B, T] an environment's per-step rewards on the policy tokens that caused the steps,
    0 elsewhere (multi-turn rollouts); None: outcome rewards only."""

    def total_scores(self) -> torch.Tensor:
        """[B] outcome plus step rewards: what the group estimators compare."""
        if self.step_rewards is None:
            return self.scores
        return self.scores + self.step_rewards.sum(dim=1).to(self.scores.dtype)


@dataclass(frozen=True)
class AdvantageOutputs:
    advantages: torch.Tensor
    """[B, T] for the policy loss; 0 on padding."""
    returns: torch.Tensor
    """[B, T] critic targets (GAE) or unwhitened advantages; 0 on padding."""
    raw_advantages: torch.Tensor
    """[B, T] before whitening (equal to advantages when the estimator does not whiten)."""
    response_mask: torch.Tensor
    whitened: bool
    lambda_policy: torch.Tensor | None = None
    """[B] float64: the GAE lambda each sequence's advantages used (gae only; logged)."""

    def raw_moments(self) -> Moments:
        """Moments of the unwhitened advantages on this rank, to all-reduce."""
        return Moments.of(self.raw_advantages, self.response_mask)

    def rewhiten(self, stats: Moments) -> AdvantageOutputs:
        """Whiten again with global moments (no-op for estimators that do not whiten)."""
        if not self.whitened:
            return self
        return replace(
            self, advantages=masked_whiten(self.raw_advantages, self.response_mask, stats)
        )


AdvantageEstimator = Callable[[AdvantageInputs, AdvantageConfig], AdvantageOutputs]
ADV_ESTIMATORS: dict[str, AdvantageEstimator] = {}
ADV_ESTIMATOR_TRAITS: dict[str, EstimatorTraits] = {}


register_adv_est = registrar(
    ADV_ESTIMATORS, "advantage estimator", ADV_ESTIMATOR_TRAITS, EstimatorTraits
)


def get_adv_estimator(name: str) -> AdvantageEstimator:
    return lookup(ADV_ESTIMATORS, name, "advantage estimator")


def estimator_traits(name: str) -> EstimatorTraits:
    """What estimator `name` needs from the run (a critic, whole groups)."""
    return lookup(ADV_ESTIMATOR_TRAITS, name, "advantage estimator")


# ---------------------------------------------------------------- building blocks


def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float | torch.Tensor,
) -> torch.Tensor:
    """Generalised Advantage Estimation (Schulman et al., arXiv 1506.02438).

    delta_t = r_t + gamma * V_{t+1} - V_t;  A_t = delta_t + gamma * lam * A_{t+1},
    with V and A after the last valid token taken as 0 and masked positions skipped.
    token_rewards, values, response_mask: [B, T]; lam: scalar or [B] (one per sequence).
    Returns advantages [B, T], 0 on padding.
    """
    mask = response_mask.bool()
    dtype = torch.promote_types(token_rewards.dtype, values.dtype)
    rewards = torch.where(mask, token_rewards, 0).to(dtype)
    values = torch.where(mask, values, 0).to(dtype)
    b, t = rewards.shape
    lam = torch.as_tensor(lam, dtype=dtype, device=rewards.device).expand(b)
    next_value = rewards.new_zeros(b)
    next_adv = rewards.new_zeros(b)
    advantages = torch.zeros_like(rewards)
    for i in reversed(range(t)):
        delta = rewards[:, i] + gamma * next_value - values[:, i]
        adv = delta + gamma * lam * next_adv
        valid = mask[:, i]
        # A masked position is skipped: what lies after it carries through unchanged.
        next_value = torch.where(valid, values[:, i], next_value)
        next_adv = torch.where(valid, adv, next_adv)
        advantages[:, i] = torch.where(valid, adv, 0)
    return advantages


def length_adaptive_lambda(
    lengths: torch.Tensor, alpha: float, fallback: float = 0.95
) -> torch.Tensor:
    """VAPO (arXiv 2504.05118): lambda_policy = 1 - 1/(alpha * l) per sequence [B] (float64).

    The paper's rule makes the GAE horizon 1/(1 - lambda) = alpha * l proportional to the
    length. For l <= 1/alpha (20 tokens at alpha = 0.05) that horizon is under one token
    and the formula gives lambda <= 0, which the paper never meets at its lengths. There we
    use `fallback` (the fixed lambda_policy) rather than 0: lambda = 0 makes the advantage a
    one-step TD error, pure critic noise when the critic is still poor. Every result lies
    in (0, 1) for lengths >= 1; empty rows get `fallback` (they have no token to use it).
    """
    lengths = lengths.double()
    horizon = alpha * lengths
    lam = 1.0 - 1.0 / horizon.clamp(min=1.0)
    return torch.where(horizon > 1.0, lam, torch.full_like(lam, fallback))


def broadcast_to_tokens(per_sequence: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, T] on valid tokens, 0 on padding."""
    return torch.where(response_mask.bool(), per_sequence[:, None], 0).to(per_sequence.dtype)


def group_stats(scores: torch.Tensor, group_index: torch.Tensor):
    """For each response, its group's size, mean and unbiased std of scores: three [B] (float64)."""
    _, inverse, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    scores = scores.double()
    sums = scores.new_zeros(len(counts)).index_add_(0, inverse, scores)
    mean = sums / counts
    sq = torch.zeros_like(sums).index_add_(0, inverse, (scores - mean[inverse]) ** 2)
    std = (sq / (counts - 1).clamp(min=1)).sqrt()
    return counts[inverse].double(), mean[inverse], std[inverse]


def _validate(inputs: AdvantageInputs) -> None:
    mask = inputs.response_mask
    check_mask(mask)
    check_per_sequence("scores", inputs.scores, mask)
    check_finite("scores", inputs.scores)
    if inputs.values is not None:
        check_same_shape("values", inputs.values, "response_mask", mask)
        check_finite("values", inputs.values, mask)
    if inputs.token_kl is not None:
        check_same_shape("token_kl", inputs.token_kl, "response_mask", mask)
        check_finite("token_kl", inputs.token_kl, mask)
    if inputs.step_rewards is not None:
        check_same_shape("step_rewards", inputs.step_rewards, "response_mask", mask)
        check_finite("step_rewards", inputs.step_rewards)
        if (inputs.step_rewards != 0)[~mask.bool()].any():
            raise ValueError("step_rewards must be 0 off the response mask (policy tokens only)")


def _token_rewards(inputs: AdvantageInputs, config: AdvantageConfig, scores=None):
    scores = inputs.scores if scores is None else scores
    kl = inputs.token_kl
    if kl is None or config.kl_coef == 0:
        kl = scores.new_zeros(inputs.response_mask.shape)
    rewards = kl_penalized_token_rewards(scores, kl, inputs.response_mask, config.kl_coef)
    if inputs.step_rewards is not None:
        rewards = rewards + inputs.step_rewards.to(rewards.dtype)
    return rewards


def _outputs(
    advantages, returns, inputs: AdvantageInputs, whiten: bool, lambda_policy=None
) -> AdvantageOutputs:
    mask = inputs.response_mask
    final = masked_whiten(advantages, mask) if whiten else advantages
    return AdvantageOutputs(final, returns, advantages, mask, whiten, lambda_policy)


# ---------------------------------------------------------------- estimators


@register_adv_est("gae", needs_critic=True)
def gae_advantages(inputs: AdvantageInputs, config: AdvantageConfig) -> AdvantageOutputs:
    """PPO with GAE; decoupled lambdas (VC-PPO, arXiv 2503.01491) and length-adaptive
    lambda_policy (VAPO, arXiv 2504.05118).

    Advantages use lambda_policy (or 1 - 1/(alpha*l) per sequence); returns = GAE with
    lambda_critic + V, so lambda_critic = 1 gives the Monte-Carlo return the critic should
    regress (with gamma = 1: the final reward, minus any KL penalty still to come).
    """
    _validate(inputs)
    if inputs.values is None:
        raise ValueError("gae needs values ([B, T] critic values of the response tokens)")
    mask, values = inputs.response_mask, inputs.values
    rewards = _token_rewards(inputs, config)
    if config.length_adaptive_alpha is not None:
        lam_policy = length_adaptive_lambda(
            mask.sum(dim=1), config.length_adaptive_alpha, config.lambda_policy
        )
    else:
        lam_policy = config.lambda_policy
    advantages = gae(rewards, values, mask, config.gamma, lam_policy)
    if config.length_adaptive_alpha is None and config.lambda_policy == config.lambda_critic:
        critic_advantages = advantages
    else:
        critic_advantages = gae(rewards, values, mask, config.gamma, config.lambda_critic)
    returns = torch.where(mask.bool(), critic_advantages + values, 0)
    per_sequence = torch.as_tensor(lam_policy, dtype=torch.float64, device=mask.device).expand(
        len(mask)
    )
    return _outputs(advantages, returns, inputs, config.whiten_advantages, per_sequence)


@register_adv_est("on_policy_distill", needs_teacher=True)
def on_policy_distill_advantages(
    inputs: AdvantageInputs, config: AdvantageConfig
) -> AdvantageOutputs:
    """On-policy distillation alone (Thinking Machines 2025): no task advantage (0 on every
    token); the experience maker adds the teacher's per-token reverse KL
    (`algorithms/distill.py`), which needs a `teacher`. The scores are still logged."""
    _validate(inputs)
    zeros = torch.zeros_like(inputs.response_mask, dtype=torch.float64)
    return _outputs(zeros, zeros, inputs, whiten=False)


@register_adv_est("grpo", needs_groups=True)
def grpo_advantages(inputs: AdvantageInputs, config: AdvantageConfig) -> AdvantageOutputs:
    """GRPO (DeepSeekMath, arXiv 2402.03300): A_i = (r_i - mean(r_group)) / (std(r_group) + eps),
    broadcast to every token of response i. std is the unbiased group std; with
    grpo_norm_by_std=False only the mean is removed (Dr. GRPO, arXiv 2503.20783)."""
    _validate(inputs)
    check_groups(inputs.group_index, len(inputs.scores), "grpo")
    scores = inputs.total_scores()
    _, mean, std = group_stats(scores, inputs.group_index)
    adv = scores.double() - mean
    if config.grpo_norm_by_std:
        adv = adv / (std + config.eps)
    advantages = broadcast_to_tokens(adv.to(inputs.scores.dtype), inputs.response_mask)
    return _outputs(advantages, advantages, inputs, whiten=False)


@register_adv_est("rloo", needs_groups=True)
def rloo_advantages(inputs: AdvantageInputs, config: AdvantageConfig) -> AdvantageOutputs:
    """RLOO (Ahmadian et al., arXiv 2402.14740): A_i = r_i - mean_{j != i} r_j
    = G/(G-1) * (r_i - mean(r_group)), broadcast to every token of response i."""
    _validate(inputs)
    check_groups(inputs.group_index, len(inputs.scores), "rloo")
    scores = inputs.total_scores()
    size, mean, _ = group_stats(scores, inputs.group_index)
    adv = size / (size - 1) * (scores.double() - mean)
    advantages = broadcast_to_tokens(adv.to(inputs.scores.dtype), inputs.response_mask)
    return _outputs(advantages, advantages, inputs, whiten=False)


def _reinforce_pp(inputs: AdvantageInputs, config: AdvantageConfig, scores) -> AdvantageOutputs:
    rewards = _token_rewards(inputs, config, scores)
    zeros = torch.zeros_like(rewards)
    returns = gae(rewards, zeros, inputs.response_mask, config.gamma, 1.0)  # return-to-go
    return _outputs(returns, returns, inputs, whiten=True)


@register_adv_est("reinforce_plus_plus")
def reinforce_pp_advantages(inputs: AdvantageInputs, config: AdvantageConfig) -> AdvantageOutputs:
    """REINFORCE++ (Hu, arXiv 2501.03262): token reward r at the last token minus
    beta * KL_t; return-to-go R_t = sum_{s>=t} gamma^(s-t) r_s; advantages whitened over all
    valid tokens of the global batch (use rewhiten with all-reduced moments). G = 1 is fine."""
    _validate(inputs)
    return _reinforce_pp(inputs, config, inputs.scores)


@register_adv_est("reinforce_plus_plus_baseline", needs_groups=True)
def reinforce_pp_baseline_advantages(
    inputs: AdvantageInputs, config: AdvantageConfig
) -> AdvantageOutputs:
    """REINFORCE++ with baseline (Hu, arXiv 2501.03262, G > 1): subtract each group's mean
    score, then as REINFORCE++ (global whitening). The paper puts KL in the loss (k2); pass
    token_kl only to fold it into the rewards instead."""
    _validate(inputs)
    check_groups(inputs.group_index, len(inputs.scores), "reinforce_plus_plus_baseline")
    # The baseline is the group's mean total return; it comes off the outcome reward (the
    # last token), so every token's return-to-go is lowered by it, step rewards staying put.
    _, mean, _ = group_stats(inputs.total_scores(), inputs.group_index)
    return _reinforce_pp(inputs, config, (inputs.scores.double() - mean).to(inputs.scores.dtype))
