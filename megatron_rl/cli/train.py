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
import gc
from typing import NoReturn

from megatron_rl.config import ConfigError, load_config
from megatron_rl.preemption import STOP
from megatron_rl.procutil import exit_now


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


def finish(trainer) -> NoReturn:
    """Close a finished rank's trainer (None: an engine rank's, closed already) and end the
    process (`exit_now`)."""
    # vLLM's engine shutdown runs two full garbage collections (0.65 s each over a rank's
    # heap of torch, megatron-core and vLLM, 2-core CPU) to free accelerator memory that an
    # exiting process does not need: what is alive now is left out of them.
    gc.freeze()
    if trainer is not None:
        trainer.close()
    exit_now()


def main(argv=None) -> NoReturn:
    """Train, and end the process (`finish`); an error leaves as an exception."""
    # First, before anything slow: a SIGUSR1/SIGTERM from now on asks for a stop instead of
    # killing the process (during start-up or loading, too).
    STOP.install()
    config = parse_args(argv)
    trainer = start_trainer(config)
    if trainer is not None:  # None: an engine rank, done
        try:
            trainer.fit()  # a stop request ends it early, saved: exit 0 either way
        except BaseException:
            trainer.close(failed=True)
            raise
    finish(trainer)


if __name__ == "__main__":
    main()
