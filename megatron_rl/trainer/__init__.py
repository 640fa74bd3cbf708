"""The RL trainer: experience maker, value pretraining, PPO/VAPO/GRPO/RLOO/REINFORCE++ loop,
checkpoints and metrics. Entry points: `megatron_rl.cli.train`, `megatron_rl.cli.value_pretrain`."""
