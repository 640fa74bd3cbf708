"""Value pretraining alone (VC-PPO, VAPO): the critic learns the frozen policy's lambda=1
Monte-Carlo returns for `critic.pretrain_steps` steps (or until explained variance reaches
`critic.pretrain_ev_threshold`), then the critic is saved as a checkpoint in
`trainer.output_dir`, from which `megatron_rl.cli.train` with the same output_dir continues.

    torchrun --nproc-per-node 2 -m megatron_rl.cli.value_pretrain --config examples/tiny/vapo.yaml
"""

from __future__ import annotations

from typing import NoReturn

from megatron_rl.cli.train import finish, parse_args, start_trainer
from megatron_rl.preemption import STOP


def main(argv=None) -> NoReturn:
    STOP.install()  # first: a signal while loading asks for a stop, it does not kill
    config = parse_args(argv, __doc__)
    if config.critic.pretrain_steps < 1:
        raise SystemExit("config error: critic.pretrain_steps must be >= 1 for value pretraining")
    trainer = start_trainer(config)
    if trainer is not None:  # None: an engine rank of a disaggregated placement, done
        try:
            if trainer.value_pretrain_done:
                print("value pretraining already done in this output_dir", flush=True)
            else:
                trainer.fit_value_pretraining()  # a stop request ends it early, saved: exit 0
        except BaseException:
            trainer.close(failed=True)
            raise
    finish(trainer)


if __name__ == "__main__":
    main()
