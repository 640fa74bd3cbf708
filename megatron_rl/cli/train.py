"""Train a policy with PPO/VAPO, GRPO, RLOO or REINFORCE++ on Megatron-core with vLLM rollouts.

    torchrun --nproc-per-node 2 -m megatron_rl.cli.train --config examples/tiny/vapo.yaml \\
        [key=value ...]

VAPO (arXiv 2504.05118): value pretraining (the critic learns lambda=1 returns of the frozen
policy), then each step: sample and score groups of responses with vLLM; reference and old
log-probs, values, advantages; PPO epochs of actor/critic updates; new weights into vLLM.
A run resumes from its newest checkpoint; SIGTERM/SIGUSR1 saves and exits cleanly. Built
in `trainer/build.py`; the loop is `RLTrainer.fit` (`trainer/runner.py`).
"""

from __future__ import annotations

import argparse

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


def start_trainer(config):
    """This rank's `RLTrainer`; None on an engine rank of a disaggregated placement, once it
    has served the trainers' rollouts until they finished (`trainer/build.py`)."""
    # here, not at the top: `--help` and a config error answer before megatron/vLLM load
    from megatron_rl.trainer.build import start_rank

    try:
        return start_rank(config)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}") from None


def main(argv=None) -> None:
    # First, before anything slow: a SIGUSR1/SIGTERM from now on asks for a stop instead of
    # killing the process (during start-up or loading, too).
    STOP.install()
    config = parse_args(argv)
    if (trainer := start_trainer(config)) is None:  # an engine rank, done
        return
    try:
        trainer.fit()  # a stop request ends it early, saved: exit 0 either way
    except BaseException:
        trainer.close(failed=True)
        raise
    trainer.close()


if __name__ == "__main__":
    main()
