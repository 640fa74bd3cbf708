"""The critic role: values of response tokens, and the clipped value-loss update
(normalised across micro-batches and DP ranks like the actor's, see `TrainableRole`)."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_rl.algorithms.losses import clipped_value_loss
from megatron_rl.data.batch import TrainingBatch, shift_to_tokens
from megatron_rl.models.architecture import ModelArchitecture
from megatron_rl.models.critic import build_critic_chunks
from megatron_rl.models.gpt import PrecisionConfig, RecomputeConfig
from megatron_rl.models.hf_mapping import load_hf_into_megatron
from megatron_rl.platform import ParallelLayout
from megatron_rl.workers.losses_config import ValueLossConfig
from megatron_rl.workers.optimizer import OptimConfig
from megatron_rl.workers.roles import TrainableRole


def token_values(head_output: torch.Tensor) -> torch.Tensor:
    """Value-head output [B, S, 1] -> V of the state before each token, [B, S] aligned."""
    return shift_to_tokens(head_output[:, :-1, 0].float())


class Critic(TrainableRole):
    def __init__(
        self,
        arch: ModelArchitecture,
        layout: ParallelLayout,
        hf_dir: str | Path | None = None,
        precision: PrecisionConfig | None = None,
        optim: OptimConfig | None = None,
        recompute: RecomputeConfig | None = None,
    ):
        """`hf_dir`: the policy's (or a reward model's) transformer weights; the value head
        starts from a small random init until a reward model's score head is converted in."""
        chunks = build_critic_chunks(arch, layout, precision, recompute=recompute)
        if hf_dir is not None:
            load_hf_into_megatron(chunks, hf_dir, arch, skip={"output_layer.weight"})
        super().__init__(arch, layout, chunks, precision, optim or OptimConfig(lr=2e-6))

    def compute_values(self, batch: TrainingBatch, num_microbatches: int = 1) -> torch.Tensor:
        """V [B, S] (aligned to tokens) on every PP rank."""
        return self.forward_collect(batch, num_microbatches, lambda mb, out: token_values(out))

    def loss(self, cfg: ValueLossConfig, counts, mb: TrainingBatch, head_output):
        tokens, seqs, _ = counts
        values = token_values(head_output)
        old = mb.old_values if mb.old_values is not None else values.detach()
        loss, metrics = clipped_value_loss(
            values,
            old,
            mb.returns,
            mb.response_mask,
            clip_eps=cfg.clip_eps,
            loss_agg_mode=cfg.loss_agg_mode,
            global_token_count=tokens,
            global_seq_count=seqs,
        )
        metrics["value_loss"] = loss
        return loss, metrics
