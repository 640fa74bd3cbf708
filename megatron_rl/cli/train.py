"""Train a policy with PPO/VAPO, GRPO, RLOO or REINFORCE++ on Megatron-core with vLLM rollouts.

    torchrun --nproc-per-node 2 -m megatron_rl.cli.train --config examples/tiny/vapo.yaml \\
        [key=value ...]

Reads like the algorithm (VAPO, arXiv 2504.05118):
  1. value pretraining: the critic learns lambda=1 returns of the frozen policy;
  2. each step: sample groups of responses with vLLM and score them; compute reference
     and old log-probs, values, advantages; several PPO epochs of actor/critic updates;
     push the new weights into vLLM.
A run resumes from its newest checkpoint; SIGTERM/SIGUSR1 saves and exits cleanly.
"""

from __future__ import annotations

import argparse
import sys

from megatron_rl.algorithms.losses import PRETRAIN_EV_WINDOW, settled_explained_variance
from megatron_rl.config import ConfigError, load_config
from megatron_rl.preemption import STOP


def parse_args(argv=None, description: str = __doc__):
    p = argparse.ArgumentParser(description=description.splitlines()[0])
    p.add_argument("--config", help="YAML file (examples/tiny/vapo.yaml, ...)")
    p.add_argument("overrides", nargs="*", help="key=value, e.g. trainer.total_steps=3")
    a = p.parse_args(argv)
    try:
        return load_config(a.config, a.overrides)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}") from None


def value_pretrain(trainer) -> None:
    interval = trainer.config.trainer.save_interval
    evs = []
    while not trainer.value_pretrain_done:
        with trainer.watchdog.watch(f"value_pretrain step {trainer.value_pretrain_step + 1}"):
            metrics = trainer.value_pretrain_step_once()
            evs.append(metrics.get("critic/vf_explained_var"))
            trainer.logger.log(
                trainer.value_pretrain_step,
                metrics,
                "value_pretrain",
                trainer.config.critic.pretrain_steps,
            )
            threshold = trainer.config.critic.pretrain_ev_threshold
            if threshold is not None and metrics.get("critic/vf_explained_var", -1e9) >= threshold:
                trainer.value_pretrain_step = trainer.config.critic.pretrain_steps  # converged
            if trainer.stop_requested_anywhere():
                trainer.save()
                sys.exit(0)
            if (
                interval
                and trainer.value_pretrain_step % interval == 0
                and not trainer.value_pretrain_done
            ):
                trainer.save()
    floor = trainer.config.critic.pretrain_ev_warn_below
    ev = settled_explained_variance(evs) if evs else None  # None: resumed after it ended
    if ev is not None and not ev >= floor and trainer.logger.enabled:  # NaN warns too
        print(
            f"warning: value pretraining ended at explained variance {ev:.3g} (mean of its "
            f"last {min(len(evs), PRETRAIN_EV_WINDOW)} steps) < {floor} "
            "(critic.pretrain_ev_warn_below): the critic explains little of the returns; "
            "more critic.pretrain_steps may help, unless the returns are not predictable "
            "from a prefix (tools/value_ceiling.py measures the ceiling on worked solutions)",
            flush=True,
        )
    trainer.save()  # the pretrained critic: PPO (or a later run) starts from it


def train(trainer) -> None:
    t = trainer.config.trainer
    total, interval, eval_interval = t.total_steps, t.save_interval, t.eval_interval
    if trainer.eval_sets and trainer.step == 0:
        with trainer.watchdog.watch("the evaluation before training"):
            trainer.logger.log(0, trainer.evaluate(), "eval")
    while trainer.step < total:
        with trainer.watchdog.watch(f"train step {trainer.step + 1}"):  # trainer.step_timeout_s
            metrics = trainer.train_step()  # rollout -> experience -> PPO epochs -> weight sync
            step = trainer.step
            if trainer.eval_sets and (
                step == total or (eval_interval and step % eval_interval == 0)
            ):
                metrics.update(trainer.evaluate())
            trainer.logger.log(step, metrics)
            stop = trainer.stop_requested_anywhere()
            if stop or step == total or (interval and step % interval == 0):
                trainer.save()  # first: on pre-emption the checkpoint is what must be complete
            if t.save_hf_interval and (step == total or step % t.save_hf_interval == 0):
                trainer.save_hf()  # a step the resumed run will not redo
            if stop:
                sys.exit(0)


def main(argv=None) -> None:
    # First, before anything slow: a SIGUSR1/SIGTERM from now on asks for a stop instead of
    # killing the process (during start-up or loading, too).
    STOP.install()
    config = parse_args(argv)
    from megatron_rl.trainer.runner import RLTrainer

    try:
        trainer = RLTrainer(config)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}") from None
    try:
        if trainer.stop_requested_anywhere():
            # asked before the first step (e.g. the scheduler's signal came while loading):
            # the checkpoint resumed from is still the newest; nothing to save
            if trainer.ctx.rank == 0:
                reason = STOP.reason or "on another rank"
                print(f"stop requested before the first step ({reason}): exiting", flush=True)
            sys.exit(0)
        if not trainer.value_pretrain_done:
            value_pretrain(trainer)
        train(trainer)
    finally:
        trainer.close()


if __name__ == "__main__":
    main()
