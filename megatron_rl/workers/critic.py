"""The critic role: values of response tokens, and the clipped value-loss update
(normalised across micro-batches and DP ranks like the actor's, see `TrainableRole`)."""

from __future__ import annotations

import torch

from megatron_rl.algorithms.losses import clipped_value_loss
from megatron_rl.data.batch import TrainingBatch, shift_to_tokens
from megatron_rl.models.critic import build_critic_chunks
from megatron_rl.models.lora import apply_lora
from megatron_rl.models.source import ModelSource
from megatron_rl.workers.losses_config import ValueLossConfig
from megatron_rl.workers.optimizer import OptimConfig
from megatron_rl.workers.roles import TrainableRole
from megatron_rl.workers.spec import RoleModel


def token_values(head_output: torch.Tensor, mb: TrainingBatch) -> torch.Tensor:
    """Value-head output [B, S, 1] ([1, T, 1] packed) -> V of the state before each token of
    `mb`, [B, S] aligned."""
    if mb.packing is not None:
        return mb.packing.to_tokens(head_output[..., 0].float())
    return shift_to_tokens(head_output[:, :-1, 0].float())


class Critic(TrainableRole):
    def __init__(self, model: RoleModel, *, optim: OptimConfig | None = None):
        """`model.model_path`: a critic checkpoint, a reward model (its score head is the
        value head) or the policy (the value head starts from a small random init); HF or
        Megatron, see `models.source.ModelSource.load_critic`."""
        chunks = build_critic_chunks(
            model.arch, model.layout, model.precision, recompute=model.recompute, moe=model.moe
        )
        if model.model_path is not None:
            ModelSource(model.model_path).load_critic(chunks, model.arch)
        if model.lora is not None and model.lora.enabled:  # the value head trains in full
            apply_lora(chunks, model.lora)
        super().__init__(
            arch=model.arch,
            layout=model.layout,
            chunks=chunks,
            precision=model.precision,
            optim=optim or OptimConfig(lr=2e-6),
            use_remove_padding=model.use_remove_padding,
        )
        self.lora = model.lora if model.lora and model.lora.enabled else None
        """The adapters' settings (a checkpoint records them); None: every weight trains."""

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
