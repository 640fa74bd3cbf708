"""The critic role: values of response tokens, and the clipped value-loss update
(normalised across micro-batches and DP ranks like the actor's, see `TrainableRole`)."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_rl.algorithms.losses import clipped_value_loss
from megatron_rl.data.batch import TrainingBatch, shift_to_tokens
from megatron_rl.models.architecture import ModelArchitecture
from megatron_rl.models.critic import build_critic_chunks
from megatron_rl.models.gpt import MoEConfig, PrecisionConfig, RecomputeConfig
from megatron_rl.models.source import ModelSource
from megatron_rl.parallel.distributed import ParallelLayout
from megatron_rl.workers.losses_config import ValueLossConfig
from megatron_rl.workers.optimizer import OptimConfig
from megatron_rl.workers.roles import TrainableRole


def token_values(head_output: torch.Tensor, mb: TrainingBatch) -> torch.Tensor:
    """Value-head output [B, S, 1] ([1, T, 1] packed) -> V of the state before each token of
    `mb`, [B, S] aligned."""
    if mb.packing is not None:
        return mb.packing.to_tokens(head_output[..., 0].float())
    return shift_to_tokens(head_output[:, :-1, 0].float())


class Critic(TrainableRole):
    def __init__(
        self,
        *,
        arch: ModelArchitecture,
        layout: ParallelLayout,
        model_path: str | Path | None = None,
        precision: PrecisionConfig | None = None,
        optim: OptimConfig | None = None,
        recompute: RecomputeConfig | None = None,
        moe: MoEConfig | None = None,
        use_remove_padding: bool = False,
    ):
        """`model_path`: a critic checkpoint, a reward model (its score head is the value
        head) or the policy (the value head starts from a small random init); HF or Megatron,
        see `models.source.ModelSource.load_critic`."""
        chunks = build_critic_chunks(arch, layout, precision, recompute=recompute, moe=moe)
        if model_path is not None:
            ModelSource(model_path).load_critic(chunks, arch)
        super().__init__(
            arch=arch,
            layout=layout,
            chunks=chunks,
            precision=precision,
            optim=optim or OptimConfig(lr=2e-6),
            use_remove_padding=use_remove_padding,
        )

    def compute_values(
        self, batch: TrainingBatch, num_microbatches: int = 1, max_tokens: int | None = None
    ) -> torch.Tensor:
        """V [B, S] (aligned to tokens) on every PP rank."""
        return self.forward_collect(
            batch, num_microbatches, lambda mb, out: token_values(out, mb), max_tokens
        )

    def loss(self, cfg: ValueLossConfig, counts, mb: TrainingBatch, head_output):
        tokens, seqs, _ = counts
        values = token_values(head_output, mb)
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
        metrics["vf_loss"] = loss
        return loss, metrics
