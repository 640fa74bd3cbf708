"""The RL trainer: experience maker, value pretraining, PPO/VAPO/GRPO/RLOO/REINFORCE++ loop,
checkpoints and metrics. Entry points: `megatron_rl.train`, `megatron_rl.value_pretrain`."""
