"""Value pretraining (VC-PPO, arXiv 2503.01491; VAPO, arXiv 2504.05118): with the policy
frozen, the critic regresses the lambda = 1 Monte-Carlo returns of its samples (the final
reward on every token when gamma = 1) for `critic.pretrain_steps` steps, or until the explained
variance reaches `critic.pretrain_ev_threshold`; then the critic is saved, and PPO (or a later
run in the same output_dir) starts from it.

`pretrain_update` is one step's update of the critic; the steps' loop (rollouts,
checkpoints, stop requests) is the trainer's (`RLTrainer.fit_value_pretraining`), which ends
with `unsettled_warning`.
"""

from __future__ import annotations

import math
from dataclasses import replace

from megatron_rl.config import TrainConfig
from megatron_rl.data.batch import mini_batches, rated_to_batch
from megatron_rl.parallel.collectives import data_parallel_explained_variance
from megatron_rl.trainer.experience import (
    compute_advantages,
    forward_micro_batching,
    micro_batching,
)
from megatron_rl.trainer.updates import (
    MiniBatchPlan,
    UpdateControl,
    balanced,
    mean_metrics,
    optimizer_steps,
)

PRETRAIN_EV_WINDOW = 5
STAGE = "value_pretrain"


def settled_explained_variance(
    per_step: list[float | None], window: int = PRETRAIN_EV_WINDOW
) -> float:
    """Where value pretraining ended: the mean explained variance of its last `window` steps
    (fewer if it ran fewer); None (NaN written to JSON) counts as NaN, so it propagates.

    Each step measures EV on that step's fresh rollout batch (128 responses of 16 prompts in
    the tiny demo), and consecutive batches swing it by +-0.2 with the critic barely changed
    (measured on one demo run: 0.58, 0.37, 0.54, 0.13, 0.25 over its last five steps), so the
    last step alone is a noisy read of the critic."""
    if not per_step:
        raise ValueError("settled_explained_variance: no value-pretraining step to read")
    last = [math.nan if ev is None else float(ev) for ev in per_step[-window:]]
    return sum(last) / len(last)


def unsettled_warning(evs: list[float | None], floor: float) -> str | None:
    """The warning printed when value pretraining ended below `critic.pretrain_ev_warn_below`
    (NaN warns too); None when it did not, or when no step ran here (resumed after it ended)."""
    ev = settled_explained_variance(evs) if evs else None
    if ev is None or ev >= floor:
        return None
    return (
        f"warning: value pretraining ended at explained variance {ev:.3g} (mean of its "
        f"last {min(len(evs), PRETRAIN_EV_WINDOW)} steps) < {floor} "
        "(critic.pretrain_ev_warn_below): the critic explains little of the returns; "
        "more critic.pretrain_steps may help, unless the returns are not predictable "
        "from a prefix (tools/value_ceiling.py measures the ceiling on worked solutions)"
    )


def pretrain_update(
    critic, groups, config: TrainConfig, pad_token_id: int, plan: MiniBatchPlan,
    control: UpdateControl,
) -> tuple[dict[str, float], list[dict]]:  # fmt: skip
    """The critic's updates on one step's rated `groups`: its values, the lambda = 1 returns
    (GAE with lambda 1 and no KL), then one pass over shuffled mini-batches. Returns the
    step's metrics and the updates' records."""
    c = config
    batch, group_index = rated_to_batch(groups, pad_token_id, critic.device)
    mask = batch.response_mask
    values = critic.compute_values(batch, **forward_micro_batching(c, c.critic, len(batch)))
    mc = replace(c.algorithm, estimator="gae", lambda_critic=1.0, kl_coef=0.0)
    returns = compute_advantages(batch, group_index, mc, values).returns.float()
    batch, balance_metrics = balanced(batch.with_fields(returns=returns, old_values=values), plan)
    roles = [(critic, c.critic.loss, micro_batching(c.critic, plan.micro_batches))]
    batches = mini_batches(batch, plan.per_rank, plan.generator)
    (records,), rewind_metrics = optimizer_steps(roles, batches, len(batches), control)
    metrics = mean_metrics(records, "critic/")
    metrics["critic/vf_explained_var"] = data_parallel_explained_variance(values, returns, mask)
    metrics.update(balance_metrics)
    metrics.update(rewind_metrics)
    return metrics, records
