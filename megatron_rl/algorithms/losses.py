"""Policy, NLL and value losses, their aggregation, entropy and explained variance.

Aggregation is where frameworks go wrong. A `token-mean` loss must be the sum over valid
tokens of the *global* batch (all micro-batches, all DP ranks) divided by the global valid-
token count: each micro-batch passes that global count in, and the sum of the micro-batch
losses is then exactly the whole-batch loss however the batch is split. The caller counts
with `token_and_sequence_counts` and all-reduces; these functions never communicate.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from megatron_rl.algorithms.checks import check_mask, check_per_sequence, check_same_shape
from megatron_rl.algorithms.masked import Moments, masked_sum
from megatron_rl.algorithms.registry import lookup, registrar

LossAggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
LOG_RATIO_CLAMP = 20.0


def token_and_sequence_counts(response_mask: torch.Tensor) -> torch.Tensor:
    """[2] float64: valid tokens and non-empty sequences of this batch, to all-reduce (SUM)."""
    mask = response_mask.double()
    return torch.stack([mask.sum(), (mask.sum(dim=1) > 0).double().sum()])


def _at_least_one(count, like: torch.Tensor) -> torch.Tensor:
    """A count (a number or a tensor) as a tensor on `like`'s device, at least 1: the
    denominator of a loss over a batch that may hold no valid token. A number is filled in
    on the device (`torch.tensor` of a number copies it from the host and waits there)."""
    if isinstance(count, torch.Tensor):
        return count.to(like.device).clamp(min=1)
    return torch.full((), max(count, 1), device=like.device)


def aggregate_loss(
    loss_bt: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: LossAggregation = "token-mean",
    global_token_count: float | torch.Tensor | None = None,
    global_seq_count: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss [B, T] to a scalar.

    - `token-mean` (DAPO 2503.14476, VAPO): sum over valid tokens / global valid tokens;
    - `seq-mean-token-mean` (PPO, GRPO): each sequence's token mean, summed / global sequences;
    - `seq-mean-token-sum` (Dr. GRPO 2503.20783): each sequence's token sum, summed / global
      sequences.
    Counts default to this batch's (exact with one micro-batch on one rank). Sequences with
    no valid token do not count. An empty batch gives 0, never NaN.
    """
    check_same_shape("loss", loss_bt, "response_mask", response_mask)
    if loss_agg_mode == "token-mean":
        count = response_mask.sum() if global_token_count is None else global_token_count
        return masked_sum(loss_bt, response_mask) / _at_least_one(count, loss_bt)
    if loss_agg_mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"loss_agg_mode {loss_agg_mode!r} is not one of {LOSS_AGGREGATIONS}")
    per_seq = masked_sum(loss_bt, response_mask, dim=1)
    if loss_agg_mode == "seq-mean-token-mean":
        per_seq = per_seq / response_mask.sum(dim=1).clamp(min=1)
    nonempty = (response_mask.sum(dim=1) > 0).sum()
    count = nonempty if global_seq_count is None else global_seq_count
    return per_seq.sum() / _at_least_one(count, per_seq)


def token_mean(
    x: torch.Tensor, response_mask: torch.Tensor, global_token_count=None
) -> torch.Tensor:
    """Sum of `x` [B, T] over valid tokens / the global valid-token count, in float64: this
    micro-batch's share of the whole batch's token mean (the mean itself without a count).
    Summed over micro-batches and DP ranks, the shares are the mini-batch's mean, what verl
    and OpenRLHF log as entropy or clipfrac; a mean of micro-batch means would weight a short
    micro-batch's tokens more."""
    return aggregate_loss(x.double(), response_mask, "token-mean", global_token_count)


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.28,
    dual_clip_c: float | None = None,
    loss_agg_mode: LossAggregation = "token-mean",
    global_token_count: float | torch.Tensor | None = None,
    global_seq_count: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (arXiv 1707.06347) with clip-higher (DAPO 2503.14476, VAPO:
    eps_low 0.2, eps_high 0.28) and optional dual-clip (Ye et al., arXiv 1912.09729, c = 3).

    L_t = max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - eps_low, 1 + eps_high)),
    and for A_t < 0 with dual clip, min(L_t, -c * A_t).
    Inputs [B, T]; returns (scalar loss, metrics): the metrics are token means, shares of the
    global batch's like the loss (`token_mean`).
    """
    check_mask(response_mask)
    for name, x in (("old_logprobs", old_logprobs), ("advantages", advantages)):
        check_same_shape(name, x, "logprobs", logprobs)
    check_same_shape("response_mask", response_mask, "logprobs", logprobs)
    if clip_eps_low < 0 or clip_eps_high < 0:
        raise ValueError(f"clip ranges must be >= 0, got low={clip_eps_low} high={clip_eps_high}")
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")

    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    loss_bt = torch.maximum(unclipped, clipped)
    active = clipped > unclipped  # the clip binds: the gradient through ratio is cut

    def share(x):
        return token_mean(x, response_mask, global_token_count)

    metrics = {
        "pg_clipfrac": share(active),
        # Which side binds: ratio below 1 - eps_low (A < 0) or above 1 + eps_high (A > 0);
        # clip-higher moves only the second.
        "pg_clipfrac_low": share(active & (ratio < 1.0)),
        "pg_clipfrac_high": share(active & (ratio > 1.0)),
    }
    if dual_clip_c is not None:
        bound = -advantages * dual_clip_c
        dual = (advantages < 0) & (loss_bt > bound)
        loss_bt = torch.where(advantages < 0, torch.minimum(loss_bt, bound), loss_bt)
        metrics["pg_clipfrac_lower"] = share(dual)
    metrics["ppo_kl"] = share(-log_ratio.detach())
    loss = aggregate_loss(
        loss_bt, response_mask, loss_agg_mode, global_token_count, global_seq_count
    )
    return loss, metrics


PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""`fn(logprobs, old_logprobs, advantages, response_mask, config, global_token_count,
global_seq_count) -> (loss, metrics)`: inputs [B, T], `config` the actor's PolicyLossConfig
(`workers.losses_config`), metrics `token_mean` shares like the loss."""

POLICY_LOSSES: dict[str, PolicyLossFn] = {}
"""Policy losses by name (`actor.loss.loss_mode`), as verl's `core_algos` registers them."""


register_policy_loss = registrar(POLICY_LOSSES, "policy loss")
"""Decorator: a new policy loss is one function with `PolicyLossFn`'s signature."""


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    return lookup(POLICY_LOSSES, name, "policy loss (loss_mode)")


@register_policy_loss("vanilla")
def vanilla_policy_loss(
    logprobs, old_logprobs, advantages, response_mask, config, global_token_count=None,
    global_seq_count=None,
):  # fmt: skip
    """PPO's clipped surrogate with clip-higher and dual-clip (`ppo_policy_loss`): PPO, GRPO,
    DAPO and VAPO all use it (verl's `vanilla`)."""
    return ppo_policy_loss(
        logprobs,
        old_logprobs,
        advantages,
        response_mask,
        clip_eps_low=config.clip_eps_low,
        clip_eps_high=config.clip_eps_high,
        dual_clip_c=config.dual_clip_c,
        loss_agg_mode=config.loss_agg_mode,
        global_token_count=global_token_count,
        global_seq_count=global_seq_count,
    )


def positive_sample_mask(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] mask of the tokens of responses whose outcome reward is positive (correct)."""
    check_per_sequence("scores", scores, response_mask)
    return response_mask.bool() & (scores > 0)[:, None]


def positive_sample_nll_loss(
    logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    scores: torch.Tensor,
    global_positive_token_count: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """VAPO's positive-example LM loss (arXiv 2504.05118, weight mu = 0.1):
    -sum of log-probs over tokens of responses with score > 0 / global count of such tokens.

    `scores` are the raw outcome rewards [B], not advantages (a GRPO advantage can be
    negative for a correct answer). 0 (with a graph) when there is no positive token.
    """
    check_same_shape("response_mask", response_mask, "logprobs", logprobs)
    positive = positive_sample_mask(scores, response_mask)
    count = positive.sum() if global_positive_token_count is None else global_positive_token_count
    return -masked_sum(logprobs, positive) / _at_least_one(count, logprobs)


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_eps: float | None = 0.5,
    loss_agg_mode: LossAggregation = "token-mean",
    global_token_count: float | torch.Tensor | None = None,
    global_seq_count: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """0.5 * max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2), aggregated like the
    policy loss (PPO, arXiv 1707.06347; clip_eps=None gives plain 0.5 * (V - R)^2).
    Returns (loss, {"vf_clipfrac": a `token_mean` share like the loss})."""
    check_mask(response_mask)
    for name, x in (("old_values", old_values), ("returns", returns)):
        check_same_shape(name, x, "values", values)
    unclipped = (values - returns).square()
    if clip_eps is None:
        loss_bt, clipfrac = 0.5 * unclipped, unclipped.new_zeros((), dtype=torch.float64)
    else:
        # Clamped to [V_old - eps, V_old + eps] directly: V itself wherever it lies inside,
        # bit for bit, so `clipped > unclipped` (vf_clipfrac) counts only tokens the clip
        # moved; V_old + clamp(V - V_old) differs from V by rounding and made it count noise.
        v_clipped = torch.clamp(values, old_values - clip_eps, old_values + clip_eps)
        clipped = (v_clipped - returns).square()
        loss_bt = 0.5 * torch.maximum(unclipped, clipped)
        clipfrac = token_mean(clipped > unclipped, response_mask, global_token_count)
    loss = aggregate_loss(
        loss_bt, response_mask, loss_agg_mode, global_token_count, global_seq_count
    )
    return loss, {"vf_clipfrac": clipfrac}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: [..., V] -> [...], computed in fp32+."""
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def explained_variance(
    values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """1 - Var(R - V) / Var(R) over valid tokens (1: perfect, 0: as good as the mean,
    < 0: worse than the mean). NaN when Var(R) = 0, where it is undefined."""
    check_same_shape("returns", returns, "values", values)
    return explained_variance_of(
        Moments.of(returns, response_mask), Moments.of(returns - values, response_mask)
    )


def explained_variance_of(returns: Moments, residuals: Moments) -> torch.Tensor:
    """Explained variance from the moments of R and of R - V, which add up over micro-batches
    and ranks: one statistic for a whole distributed batch, not a mean of per-part ones
    (biased, and undefined on parts whose returns are constant)."""
    var_r = returns.var
    return torch.where(var_r > 0, 1 - residuals.var / var_r, torch.full_like(var_r, float("nan")))
