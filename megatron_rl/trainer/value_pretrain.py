"""Value pretraining (VC-PPO, arXiv 2503.01491; VAPO, arXiv 2504.05118): with the policy
frozen, the critic regresses the lambda = 1 Monte-Carlo returns of its samples (the final
reward on every token when gamma = 1) for `critic.pretrain_steps` steps, or until the explained
variance reaches `critic.pretrain_ev_threshold`; then the critic is saved, and PPO (or a later
run in the same output_dir) starts from it.

`pretrain_step` is one step, `run_value_pretraining` the loop (checkpoints, stop requests, the
settled-EV warning); the trainer (`trainer/runner.py`) supplies the roles, engine and data.
"""

from __future__ import annotations

import math
from dataclasses import replace

from megatron_rl.data.batch import mini_batches, rated_to_batch
from megatron_rl.parallel.collectives import data_parallel_explained_variance, reduce_over_ranks
from megatron_rl.trainer.experience import (
    compute_advantages,
    forward_micro_batching,
    micro_batching,
)
from megatron_rl.trainer.updates import mean_metrics, nonfinite_streak, optimizer_steps

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


def pretrain_update(trainer, groups, step: int) -> dict[str, float]:
    """The critic's updates on one step's rated `groups`: its values, the lambda = 1 returns
    (GAE with lambda 1 and no KL), then one pass over shuffled mini-batches."""
    c, critic = trainer.config, trainer.critic
    batch, group_index = rated_to_batch(groups, trainer.pad_token_id, critic.device)
    mask = batch.response_mask
    per_rank, nmb = trainer.minibatch_plan()
    values = critic.compute_values(batch, **forward_micro_batching(c, "critic", len(batch)))
    mc = replace(c.algorithm, estimator="gae", lambda_critic=1.0, kl_coef=0.0)
    returns = compute_advantages(batch, group_index, mc, values).returns.float()
    batch, balance_metrics = trainer.balanced(batch.with_fields(returns=returns, old_values=values))
    roles = [(critic, c.critic.loss, micro_batching(c.critic, nmb))]
    batches = mini_batches(batch, per_rank, trainer.update_generator(STAGE, step))
    (records,), rewind_metrics = optimizer_steps(trainer, roles, batches, len(batches))
    trainer.nonfinite_in_a_row = nonfinite_streak(
        trainer.nonfinite_in_a_row, records, c.trainer.max_nonfinite_in_a_row
    )
    trainer.offload_trained_roles()
    metrics = mean_metrics(records, "critic/")
    metrics["critic/vf_explained_var"] = data_parallel_explained_variance(values, returns, mask)
    metrics.update(balance_metrics)
    metrics.update(rewind_metrics)
    return metrics


def pretrain_step(trainer) -> dict[str, float]:
    """One value-pretraining step: rollout of the frozen policy, then the critic's update;
    the step's metrics reduced over ranks."""
    step = trainer.value_pretrain_step
    with trainer.phase("rollout"):
        groups, metrics = trainer.generate_and_score(STAGE, step)
    if not groups:
        trainer.value_pretrain_step += 1
        metrics.update(trainer.memory.end_step(trainer.value_pretrain_step, STAGE))
        return reduce_over_ranks({**metrics, "actor/skipped_update": 1.0})
    trainer.abort_point("train")  # before the critic's values and gradients
    trainer.sleep_engine(level=1)  # the policy is frozen: its weights wait in host memory
    with trainer.phase("train"):
        metrics.update(pretrain_update(trainer, groups, step))
    trainer.wake_engine()
    trainer.value_pretrain_step += 1
    metrics["memory/params_offloaded_gib"] = trainer.offloaded_param_gib()
    metrics.update(trainer.memory.end_step(trainer.value_pretrain_step, STAGE))
    return reduce_over_ranks(metrics)


def run_value_pretraining(trainer) -> bool:
    """Value pretraining until done (a checkpoint every `trainer.save_interval` steps and at
    the end). Returns False when a stop request ended it early (saved first), else True."""
    c = trainer.config
    interval, total = c.trainer.save_interval, c.critic.pretrain_steps
    threshold = c.critic.pretrain_ev_threshold
    evs = []
    while not trainer.value_pretrain_done:
        with trainer.watchdog.watch(f"value_pretrain step {trainer.value_pretrain_step + 1}"):
            metrics = trainer.abortable_step(STAGE, lambda: pretrain_step(trainer))
            if metrics is None:  # a stop request: the step's start is saved
                return False
            evs.append(metrics.get("critic/vf_explained_var"))
            trainer.logger.log(trainer.value_pretrain_step, metrics, STAGE, total)
            if threshold is not None and metrics.get("critic/vf_explained_var", -1e9) >= threshold:
                trainer.value_pretrain_step = total  # converged
            if trainer.stop_requested_anywhere():
                trainer.save()
                return False
            if (
                interval
                and trainer.value_pretrain_step % interval == 0
                and not trainer.value_pretrain_done
            ):
                trainer.save()
    warning = unsettled_warning(evs, c.critic.pretrain_ev_warn_below)
    if warning and trainer.logger.enabled:
        print(warning, flush=True)
    trainer.save()  # the pretrained critic: PPO (or a later run) starts from it
    return True
