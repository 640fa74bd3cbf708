"""Train a policy with PPO/VAPO, GRPO, RLOO or REINFORCE++ on Megatron-core with vLLM rollouts.

    torchrun --nproc-per-node 2 -m megatron_rl.cli.train --config examples/tiny/vapo.yaml \\
        [key=value ...]

Reads like the algorithm (VAPO, arXiv 2504.05118):
  1. value pretraining: the critic learns lambda=1 returns of the frozen policy;
  2. each step: sample groups of responses with vLLM and score them; compute reference
     and old log-probs, values, advantages; several PPO epochs of actor/critic updates;
     push the new weights into vLLM.
A run resumes from its newest checkpoint; SIGTERM/SIGUSR1 saves and exits cleanly. The loop
is `RLTrainer.fit` (`megatron_rl/trainer/runner.py`).
"""

from __future__ import annotations

import argparse
import os

from megatron_rl.config import ConfigError, load_config, validate_config
from megatron_rl.parallel.placement import ENGINE, Placement, initialize_role
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


def start_trainer(config):
    """This rank's `RLTrainer`; None on an engine rank of a disaggregated placement
    (`rollout.placement`), which serves the trainers' rollouts here until they are done."""
    # here, not at the top: `--help` and a config error answer before megatron/vLLM load
    from megatron_rl.trainer.runner import RLTrainer

    try:
        if config.rollout.placement == "colocated":
            return RLTrainer(config)
        world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        validate_config(config, world_size)  # on every rank, before any process group
        placement = Placement(world_size, config.rollout.engine_ranks)
        role, store = initialize_role(placement)
        if role != ENGINE:
            return RLTrainer(config, roles=(placement, store))
    except ConfigError as e:
        raise SystemExit(f"config error: {e}") from None
    # why here: only engine ranks load it (vLLM, no Megatron)
    from megatron_rl.trainer.engine_worker import EngineWorker

    STOP.share_through(store, rank)  # a request on any rank reaches this one, and back
    worker = EngineWorker(config, placement, store, rank)
    try:
        worker.run()
    finally:
        worker.close()
    return None


def main(argv=None) -> None:
    # First, before anything slow: a SIGUSR1/SIGTERM from now on asks for a stop instead of
    # killing the process (during start-up or loading, too).
    STOP.install()
    config = parse_args(argv)
    trainer = start_trainer(config)
    if trainer is None:  # an engine rank, done
        return
    try:
        trainer.fit()  # a stop request ends it early, saved: exit 0 either way
    except BaseException:
        trainer.close(failed=True)
        raise
    trainer.close()


if __name__ == "__main__":
    main()
