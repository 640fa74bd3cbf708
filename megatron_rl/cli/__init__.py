"""Entry points, each run as `python -m megatron_rl.cli.NAME` (under torchrun where it trains):

- `train`: value pretraining (when configured), then PPO/VAPO, GRPO, RLOO or REINFORCE++;
- `value_pretrain`: value pretraining alone, into an output_dir `train` continues from;
- `sft`: the supervised warm start of the demo;
- `demo`: `make demo` (tiny model, warm start, VAPO on three seeds, the learning table);
- `demo_tp_step`: one tensor-parallel forward/backward checked against Hugging Face;
- `latest_checkpoint`: the checkpoint a run would resume from (the sbatch script's progress
  check).

`python -m megatron_rl.launch` (torchrun for clusters) starts any of them on every node.
"""
