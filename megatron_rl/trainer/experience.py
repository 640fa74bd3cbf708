"""Experience maker: rated samples -> a TrainingBatch with everything the losses read.

samples -> tokens + response mask, scores, groups
        -> reference log-probs (only when a KL term is on)
        -> old log-probs (the actor before this step's updates)
        -> values (only with a critic)
        -> advantages and returns (the configured estimator; whitening with moments
           all-reduced over data-parallel ranks, so it is global)
"""

from __future__ import annotations

import torch

from megatron_rl.algorithms.advantages import (
    AdvantageConfig,
    AdvantageInputs,
    AdvantageOutputs,
    get_adv_estimator,
)
from megatron_rl.algorithms.kl import kl_estimate
from megatron_rl.algorithms.losses import explained_variance_of
from megatron_rl.algorithms.masked import Moments, masked_mean
from megatron_rl.rollout.parity import samples_to_batch
from megatron_rl.workers.batch import TrainingBatch


def engine_logprobs_of(samples, batch: TrainingBatch) -> torch.Tensor:
    """The engine's log-probs of the sampled tokens, [B, S] aligned like the actor's."""
    out = torch.zeros(batch.input_ids.shape)
    for i, s in enumerate(samples):
        start = len(s.prompt_token_ids)
        out[i, start : start + len(s.logprobs)] = torch.tensor(s.logprobs)
    return out


def rated_to_batch(groups, pad_token_id: int) -> tuple[TrainingBatch, torch.Tensor]:
    """(batch with `scores`, group index [B]) from a rollout's groups of `RatedSample`s."""
    rated = [r for g in groups for r in g]
    batch = samples_to_batch([r.sample for r in rated], pad_token_id)
    scores = torch.tensor([r.reward for r in rated], dtype=torch.float32)
    group_index = torch.tensor([i for i, g in enumerate(groups) for _ in g])
    return batch.with_fields(scores=scores), group_index


def forward_microbatches(rows: int, micro_batch_size: int) -> int:
    """Micro-batches for a forward-only pass: about `micro_batch_size` rows each, equal sizes
    (the pipeline schedule needs one shape)."""
    k = max(1, -(-rows // micro_batch_size))
    while rows % k:
        k += 1
    return k


def data_parallel_moments(m: Moments) -> Moments:
    from megatron.core import parallel_state

    t = m.as_tensor()
    if parallel_state.get_data_parallel_world_size() > 1:
        torch.distributed.all_reduce(t, group=parallel_state.get_data_parallel_group())
    return Moments.from_tensor(t)


def data_parallel_explained_variance(
    values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor
) -> float:
    """Explained variance of the critic's values [B, S] for the returns [B, S] over every
    response token of the DP-global batch (the values before this step's update, as verl's
    vf_explained_var)."""
    return explained_variance_of(
        data_parallel_moments(Moments.of(returns, response_mask)),
        data_parallel_moments(Moments.of(returns - values, response_mask)),
    ).item()


def compute_advantages(
    batch: TrainingBatch,
    group_index: torch.Tensor,
    config: AdvantageConfig,
    values: torch.Tensor | None = None,
    token_kl: torch.Tensor | None = None,
) -> AdvantageOutputs:
    """The estimator's outputs ([B, S] aligned to tokens) with DP-global whitening."""
    inputs = AdvantageInputs(
        scores=batch.scores.double(),
        response_mask=batch.response_mask,
        values=None if values is None else values.double(),
        group_index=group_index,
        token_kl=None if token_kl is None else token_kl.double(),
    )
    out = get_adv_estimator(config.estimator)(inputs, config)
    return out.rewhiten(data_parallel_moments(out.raw_moments()))


def make_experience(
    groups, actor, critic, reference, config, micro_batch_size: int, pad_token_id: int
) -> tuple[TrainingBatch, dict[str, float]]:
    """`groups`: this rank's rated groups; `config`: the TrainConfig. Returns the batch and
    the experience metrics (KL, log-prob gap engine vs trainer, advantage/value means)."""
    batch, group_index = rated_to_batch(groups, pad_token_id)
    nmb = forward_microbatches(len(batch), micro_batch_size)
    mask = batch.response_mask
    old = actor.compute_logprobs(batch, nmb)
    fields = {"old_logprobs": old}
    metrics = {}
    token_kl = None
    if reference is not None:
        ref = reference.compute_logprobs(batch, nmb)
        fields["ref_logprobs"] = ref
        token_kl = kl_estimate(old, ref, "k1")
        metrics["kl"] = masked_mean(token_kl, mask).item()
        if config.algorithm.kl_coef == 0:
            token_kl = None  # KL only in the loss (GRPO): not folded into the rewards
    values = None
    if critic is not None:
        values = critic.compute_values(batch, nmb)
        fields["old_values"] = values
    out = compute_advantages(batch, group_index, config.algorithm, values, token_kl)
    advantages, returns = out.advantages.float(), out.returns.float()
    if out.lambda_policy is not None:  # per sequence; rows without a token never use it
        lam = out.lambda_policy[mask.sum(dim=1) > 0]
        if lam.numel():
            metrics["lambda_policy_mean"] = lam.mean().item()
            metrics["lambda_policy_min"] = lam.min().item()
    engine_lp = engine_logprobs_of([r.sample for g in groups for r in g], batch)
    gap = (engine_lp - old).abs()[mask.bool()]
    metrics.update(
        {
            "logprob_gap_mean": gap.mean().item() if gap.numel() else 0.0,
            "logprob_gap_max": gap.max().item() if gap.numel() else 0.0,
            "advantages_mean": masked_mean(advantages, mask).item(),
            "returns_mean": masked_mean(returns, mask).item(),
        }
    )
    if values is not None:
        metrics["values_mean"] = masked_mean(values, mask).item()
        metrics["critic/explained_variance"] = data_parallel_explained_variance(
            values, returns, mask
        )
    return batch.with_fields(advantages=advantages, returns=returns, **fields), metrics


def mini_batches(
    batch: TrainingBatch, size: int, generator: torch.Generator
) -> list[TrainingBatch]:
    """Shuffled mini-batches of `size` rows (PPO reuses a batch over several epochs)."""
    order = torch.randperm(len(batch), generator=generator)
    out = []
    for start in range(0, len(batch) - size + 1, size):
        idx = order[start : start + size]
        out.append(
            TrainingBatch(
                **{
                    f: (None if getattr(batch, f) is None else getattr(batch, f)[idx])
                    for f in batch.__dataclass_fields__
                }
            )
        )
    return out
