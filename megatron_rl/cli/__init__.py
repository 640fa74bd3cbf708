"""Entry points, each run as `python -m megatron_rl.cli.NAME` (under torchrun where it trains):

- `train`: value pretraining (when configured), then PPO/VAPO, GRPO, RLOO or REINFORCE++;
- `value_pretrain`: value pretraining alone, into an output_dir `train` continues from;
- `doctor`: the installed stack and what it can run;
- `latest_checkpoint`: the checkpoint a run would resume from (the sbatch script's progress
  check).

`python -m megatron_rl.launch` (torchrun for clusters) starts any of them on every node. The demo and its supervised warm start live under
`examples/` (`python -m examples.demo.demo`), outside the installed package.
"""
