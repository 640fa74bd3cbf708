"""The critic role: values of response tokens, and the clipped value-loss update.

The value-loss normalisation across micro-batches and DP ranks is the actor's (see
`megatron_rl.workers.policy`): global counts once per mini-batch, then scaled micro-batches.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from megatron_rl.algorithms.losses import clipped_value_loss, explained_variance
from megatron_rl.models.architecture import ModelArchitecture
from megatron_rl.models.critic import build_critic_chunks
from megatron_rl.models.gpt import PrecisionConfig
from megatron_rl.models.hf_mapping import load_hf_into_megatron
from megatron_rl.platform import ParallelLayout
from megatron_rl.workers.batch import TrainingBatch
from megatron_rl.workers.losses_config import ValueLossConfig
from megatron_rl.workers.megatron_model import (
    OptimConfig,
    broadcast_from_last_stage,
    run_schedule,
    shift_to_tokens,
    wrap_ddp_and_optimizer,
)
from megatron_rl.workers.policy import global_counts


def token_values(head_output: torch.Tensor) -> torch.Tensor:
    """Value-head output [B, S, 1] -> V of the state before each token, [B, S] aligned."""
    return shift_to_tokens(head_output[:, :-1, 0].float())


class Critic:
    def __init__(
        self,
        arch: ModelArchitecture,
        layout: ParallelLayout,
        hf_dir: str | Path | None = None,
        precision: PrecisionConfig | None = None,
        optim: OptimConfig | None = None,
    ):
        """`hf_dir`: the policy (or a reward model's) transformer weights; the value head
        starts from a small random init until a reward model's score head is converted in."""
        self.arch, self.layout = arch, layout
        chunks = build_critic_chunks(arch, layout, precision)
        if hf_dir is not None:
            load_hf_into_megatron(chunks, hf_dir, arch, skip={"output_layer.weight"})
        self.chunks, self.optimizer = wrap_ddp_and_optimizer(chunks, optim or OptimConfig(lr=2e-6))

    @torch.no_grad()
    def compute_values(self, batch: TrainingBatch, num_microbatches: int = 1) -> torch.Tensor:
        """V [B, S] (aligned to tokens) on every PP rank."""
        for chunk in self.chunks:
            chunk.eval()
        parts = run_schedule(
            self.chunks,
            batch.split(num_microbatches),
            lambda mb, out: token_values(out),
            forward_only=True,
            collect_outputs=True,
        )
        return broadcast_from_last_stage(parts, batch.input_ids.shape, torch.float32)

    def _loss(self, cfg: ValueLossConfig, counts, scale: float, mb: TrainingBatch, head_output):
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
        metrics["value_loss"] = loss.detach().clone()
        metrics["explained_variance"] = explained_variance(
            values.detach(), mb.returns, mb.response_mask
        )
        return loss * scale, metrics

    def compute_gradients(
        self, batch: TrainingBatch, cfg: ValueLossConfig, num_microbatches: int = 1
    ) -> dict[str, float]:
        from megatron.core import parallel_state

        for chunk in self.chunks:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        counts = global_counts(batch)
        scale = num_microbatches * parallel_state.get_data_parallel_world_size()
        metrics = run_schedule(
            self.chunks,
            batch.split(num_microbatches),
            partial(self._loss, cfg, counts, scale),
            forward_only=False,
        )
        if not metrics:
            return {}
        return {
            k: torch.stack([m[k] for m in metrics]).float().nanmean().item() for k in metrics[0]
        }

    def update(
        self, batch: TrainingBatch, cfg: ValueLossConfig, num_microbatches: int = 1
    ) -> dict[str, float]:
        metrics = self.compute_gradients(batch, cfg, num_microbatches)
        ok, grad_norm, _ = self.optimizer.step()
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["update_ok"] = bool(ok)
        return metrics
