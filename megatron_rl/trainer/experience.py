"""Experience maker: rated samples -> a TrainingBatch with everything the losses read.

samples -> tokens + response mask, scores, groups
        -> old log-probs (the actor before this step's updates)
        -> reference log-probs (only when a KL term is on)
        -> teacher log-probs (on-policy distillation: a `teacher` is configured)
        -> values (only with a critic)
        -> advantages and returns (the configured estimator; whitening with moments
           all-reduced over data-parallel ranks, so it is global), plus the teacher's
           per-token reverse KL (`algorithms/distill.py`)
        -> rollout correction: the engine's log-probs against the old ones (diagnostics
           every step; importance weights / rejection when configured)

Multi-turn samples carry environment tokens: out of the response mask (samples_to_batch),
so no estimator, loss or metric counts them; their environments' step rewards enter the
estimator (`step_rewards_of`); the log-prob gap is also reported per turn, in the same
all-reduce as the rest of the diagnostics, for runs whose samples have a second turn.
"""

from __future__ import annotations

import math

import torch

from megatron_rl.algorithms.advantages import (
    AdvantageConfig,
    AdvantageInputs,
    AdvantageOutputs,
    get_adv_estimator,
)
from megatron_rl.algorithms.distill import add_distillation, teacher_reverse_kl
from megatron_rl.algorithms.kl import kl_estimate
from megatron_rl.algorithms.masked import masked_mean
from megatron_rl.algorithms.rollout_correction import (
    compute_rollout_correction,
    diagnostics_metrics,
    pack_diagnostics,
    turn_gap_sums,
)
from megatron_rl.config import TrainConfig
from megatron_rl.data.batch import (
    TrainingBatch,
    engine_logprobs_of,
    forward_microbatches,
    rated_to_batch,
    step_rewards_of,
    turn_index_of,
)
from megatron_rl.parallel.collectives import (
    data_parallel_explained_variance,
    data_parallel_max,
    data_parallel_moments,
    data_parallel_sum,
)


def compute_advantages(
    batch: TrainingBatch,
    group_index: torch.Tensor,
    config: AdvantageConfig,
    values: torch.Tensor | None = None,
    token_kl: torch.Tensor | None = None,
    step_rewards: torch.Tensor | None = None,
) -> AdvantageOutputs:
    """The estimator's outputs ([B, S] aligned to tokens) with DP-global whitening."""
    inputs = AdvantageInputs(
        scores=batch.scores.double(),
        response_mask=batch.response_mask,
        values=None if values is None else values.double(),
        group_index=group_index,
        token_kl=None if token_kl is None else token_kl.double(),
        step_rewards=step_rewards,
    )
    out = get_adv_estimator(config.estimator)(inputs, config)
    return out.rewhiten(data_parallel_moments(out.raw_moments()))


def micro_batching(role_cfg, num_microbatches: int, forward: bool = False) -> dict:
    """A role's split keywords: its token budget (`use_dynamic_bsz`), else
    `num_microbatches` equal micro-batches."""
    budget = role_cfg.token_budget(forward)
    return {"max_tokens": budget} if budget else {"num_microbatches": num_microbatches}


def forward_micro_batching(config: TrainConfig, role_cfg, rows: int) -> dict:
    """Split of a forward-only pass over `rows` of the role whose section is `role_cfg`
    (`config.actor`, also for the reference, or `config.critic`); the count of equal
    micro-batches is the actor's micro-batch size either way."""
    nmb = forward_microbatches(rows, config.actor.micro_batch_size)
    return micro_batching(role_cfg, nmb, forward=True)


def make_experience(
    groups,
    actor,
    critic,
    reference,
    config: TrainConfig,
    pad_token_id: int,
    before_forward=None,
    teacher=None,
) -> tuple[TrainingBatch, dict[str, float]]:
    """`groups`: this rank's rated groups; `config`: the TrainConfig; `teacher`: the
    distillation teacher's role, or None. Returns the batch, on the actor's device, and the
    experience metrics under their logged names (KL, engine vs trainer log-probs,
    advantage/value means). `before_forward(role)`, when given, runs before each role's
    forward pass (the trainer's abort point: it may raise)."""

    def starting(role: str) -> None:
        if before_forward is not None:
            before_forward(role)

    batch, group_index = rated_to_batch(groups, pad_token_id, actor.device)
    split = forward_micro_batching(config, config.actor, len(batch))
    mask = batch.response_mask
    samples = [r.sample for g in groups for r in g]
    engine_lp = engine_logprobs_of(samples, batch)
    rc_config = config.algorithm.rollout_correction
    if rc_config.bypass_mode:  # pi_old is the behaviour policy: no actor forward
        old = engine_lp
    else:
        starting("actor")
        old = actor.compute_logprobs(batch, **split)
    fields = {"old_logprobs": old}
    metrics = dict(actor.routing_metrics) if not rc_config.bypass_mode else {}
    token_kl = None
    if reference is not None:
        starting("reference")
        ref = reference.compute_logprobs(batch, **split)
        fields["ref_logprobs"] = ref
        token_kl = kl_estimate(old, ref, "k1")
        metrics["actor/reward_kl"] = masked_mean(token_kl, mask).item()
        if config.algorithm.kl_coef == 0:
            token_kl = None  # KL only in the loss (GRPO): not folded into the rewards
    reverse_kl = None
    if teacher is not None:
        starting("teacher")
        reverse_kl = teacher_reverse_kl(old, teacher.compute_logprobs(batch, **split), mask)
        metrics["actor/teacher_kl"] = masked_mean(reverse_kl, mask).item()
        metrics["actor/teacher_kl_max"] = data_parallel_max(
            reverse_kl[mask.bool()].max(dim=0, keepdim=True).values
            if mask.any()
            else torch.full((1,), -math.inf, device=mask.device)
        ).item()
    values = None
    if critic is not None:
        starting("critic")
        values = critic.compute_values(
            batch, **forward_micro_batching(config, config.critic, len(batch))
        )
        fields["old_values"] = values
    step_rewards = step_rewards_of(samples, batch)
    out = compute_advantages(batch, group_index, config.algorithm, values, token_kl, step_rewards)
    advantages, returns = out.advantages.float(), out.returns.float()
    if reverse_kl is not None:
        advantages = add_distillation(advantages, reverse_kl, config.teacher.kl_coef)
    if out.lambda_policy is not None:  # per sequence; rows without a token never use it
        lam = out.lambda_policy[mask.sum(dim=1) > 0]
        # the DP-global min (every rank takes part): the ranks' means then average it unchanged
        low = lam.min().item() if lam.numel() else math.inf
        low = -data_parallel_max(
            torch.tensor([-low], dtype=torch.float64, device=mask.device)
        ).item()
        if lam.numel():
            metrics["algorithm/lambda_policy/mean"] = lam.mean().item()
            metrics["algorithm/lambda_policy/min"] = low
    metrics.update(
        {
            "algorithm/advantages/mean": masked_mean(advantages, mask).item(),
            "algorithm/returns/mean": masked_mean(returns, mask).item(),
        }
    )
    if values is not None:
        metrics["critic/values/mean"] = masked_mean(values, mask).item()
        metrics["critic/vf_explained_var"] = data_parallel_explained_variance(values, returns, mask)
    if rc_config.bypass_mode:  # old is the engine's: its gap to itself says nothing
        return batch.with_fields(advantages=advantages, returns=returns, **fields), metrics
    rc = compute_rollout_correction(old, engine_lp, mask, rc_config)
    turns = turn_gap_sums(old, engine_lp, mask, turn_index_of(samples, batch))
    sums, maxima = pack_diagnostics(rc, *turns)
    metrics.update(diagnostics_metrics(data_parallel_sum(sums), data_parallel_max(maxima)))
    if rc.weights is not None:
        fields["rollout_is_weights"] = rc.weights
    if rc_config.rejects:
        # Rejected tokens leave the update (actor and critic) and its token counts; the
        # advantages above were computed over the whole responses.
        fields["response_mask"] = rc.keep
    return batch.with_fields(advantages=advantages, returns=returns, **fields), metrics
