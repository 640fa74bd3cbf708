"""The policy roles: ReferencePolicy (forward-only) and Actor (trains with PPO/VAPO losses).

Token-level loss across micro-batches and DP ranks (the VAPO/DAPO `token-mean`): before a
mini-batch, the valid-token, non-empty-sequence and positive-token counts of the whole
global batch are all-reduced over DP once; every micro-batch normalises its loss terms by
those global counts and multiplies by num_microbatches * dp_size, which megatron's average
over micro-batches and DDP's average over ranks then cancel. The gradient is exactly that
of the whole global batch, however it is split (tests/test_workers_distributed.py).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from megatron_rl.algorithms.kl import kl_estimate
from megatron_rl.algorithms.losses import (
    aggregate_loss,
    positive_sample_nll_loss,
    ppo_policy_loss,
    token_and_sequence_counts,
)
from megatron_rl.algorithms.masked import masked_mean
from megatron_rl.models.architecture import ModelArchitecture
from megatron_rl.models.gpt import PrecisionConfig, build_gpt_model_chunks
from megatron_rl.models.hf_mapping import load_hf_into_megatron
from megatron_rl.parallel.vocab import vocab_parallel_entropy, vocab_parallel_logprobs
from megatron_rl.platform import ParallelLayout
from megatron_rl.workers.batch import TrainingBatch
from megatron_rl.workers.losses_config import PolicyLossConfig
from megatron_rl.workers.megatron_model import (
    OptimConfig,
    broadcast_from_last_stage,
    run_schedule,
    shift_to_tokens,
    wrap_ddp_and_optimizer,
)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Vocab-sharded logits [B, S, V/tp] -> log-probs of each token given its prefix [B, S]."""
    return shift_to_tokens(vocab_parallel_logprobs(logits[:, :-1], input_ids[:, 1:], vocab_size))


def token_entropy(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Entropy of the distribution each token was drawn from: [B, S] aligned to tokens."""
    return shift_to_tokens(vocab_parallel_entropy(logits[:, :-1], vocab_size))


def global_counts(batch: TrainingBatch) -> torch.Tensor:
    """[3] float64: valid tokens, non-empty sequences, positive-sample tokens, summed over DP."""
    from megatron.core import parallel_state

    counts = token_and_sequence_counts(batch.response_mask)
    positive = torch.zeros((), dtype=torch.float64)
    if batch.scores is not None:
        positive = (batch.response_mask.bool() & (batch.scores > 0)[:, None]).sum().double()
    counts = torch.cat([counts, positive[None]])
    if parallel_state.get_data_parallel_world_size() > 1:
        torch.distributed.all_reduce(counts, group=parallel_state.get_data_parallel_group())
    return counts


class ReferencePolicy:
    """Forward-only copy of the policy: no optimizer state, no gradients.

    Build it only when a KL coefficient is > 0 (the trainer skips it entirely otherwise).
    """

    def __init__(
        self,
        arch: ModelArchitecture,
        layout: ParallelLayout,
        hf_dir: str | Path | None = None,
        precision: PrecisionConfig | None = None,
    ):
        self.arch, self.layout = arch, layout
        self.chunks = build_gpt_model_chunks(arch, layout, precision)
        if hf_dir is not None:
            load_hf_into_megatron(self.chunks, hf_dir, arch)
        for chunk in self.chunks:
            chunk.requires_grad_(False)

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainingBatch, num_microbatches: int = 1) -> torch.Tensor:
        """Log-probs [B, S] of `batch.input_ids`, aligned to tokens, on every PP rank."""
        for chunk in self.chunks:
            chunk.eval()

        def collect(mb, logits):
            return token_logprobs(logits, mb.input_ids, self.arch.vocab_size)

        parts = run_schedule(
            self.chunks,
            batch.split(num_microbatches),
            collect,
            forward_only=True,
            collect_outputs=True,
        )
        return broadcast_from_last_stage(parts, batch.input_ids.shape, torch.float32)


class Actor(ReferencePolicy):
    """The trained policy: DDP-wrapped chunks, megatron optimizer, PPO/VAPO losses."""

    def __init__(
        self,
        arch: ModelArchitecture,
        layout: ParallelLayout,
        hf_dir: str | Path | None = None,
        precision: PrecisionConfig | None = None,
        optim: OptimConfig | None = None,
    ):
        self.arch, self.layout = arch, layout
        chunks = build_gpt_model_chunks(arch, layout, precision)
        if hf_dir is not None:
            load_hf_into_megatron(chunks, hf_dir, arch)
        self.chunks, self.optimizer = wrap_ddp_and_optimizer(chunks, optim or OptimConfig())

    def _loss(self, cfg: PolicyLossConfig, counts, scale: float, mb: TrainingBatch, logits):
        tokens, seqs, positive = counts
        mask = mb.response_mask
        logprobs = token_logprobs(logits, mb.input_ids, self.arch.vocab_size)
        pg_loss, metrics = ppo_policy_loss(
            logprobs,
            mb.old_logprobs,
            mb.advantages,
            mask,
            clip_eps_low=cfg.clip_eps_low,
            clip_eps_high=cfg.clip_eps_high,
            dual_clip_c=cfg.dual_clip_c,
            loss_agg_mode=cfg.loss_agg_mode,
            global_token_count=tokens,
            global_seq_count=seqs,
        )
        loss = pg_loss
        if cfg.nll_coef > 0:
            nll = positive_sample_nll_loss(logprobs, mask, mb.scores, positive)
            loss = loss + cfg.nll_coef * nll
            metrics["nll_loss"] = nll.detach().clone()
        entropy = token_entropy(logits, self.arch.vocab_size)
        if cfg.entropy_coef > 0:
            ent = aggregate_loss(entropy, mask, cfg.loss_agg_mode, tokens, seqs)
            loss = loss - cfg.entropy_coef * ent
        if cfg.kl_loss_coef > 0:
            if mb.ref_logprobs is None:
                raise ValueError("kl_loss_coef > 0 needs ref_logprobs in the batch")
            kl = kl_estimate(logprobs, mb.ref_logprobs, cfg.kl_estimator)
            kl_loss = aggregate_loss(kl, mask, cfg.loss_agg_mode, tokens, seqs)
            loss = loss + cfg.kl_loss_coef * kl_loss
            metrics["kl_loss"] = kl_loss.detach().clone()
        metrics["pg_loss"] = pg_loss.detach().clone()
        metrics["entropy"] = masked_mean(entropy.detach(), mask)
        # Megatron divides by num_microbatches (in place, hence the clones above) and DDP
        # averages over DP ranks; the scale undoes both so the sum is the global mean.
        return loss * scale, metrics

    def compute_gradients(
        self, batch: TrainingBatch, cfg: PolicyLossConfig, num_microbatches: int = 1
    ) -> dict[str, float]:
        """Zero, then accumulate this DP rank's share of the global-batch gradient into DDP's
        main_grad (reduced over DP and, for SP norms, TP). Returns averaged metrics."""
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
        return (
            {k: torch.stack([m[k] for m in metrics]).mean().item() for k in metrics[0]}
            if metrics
            else {}
        )

    def update(
        self, batch: TrainingBatch, cfg: PolicyLossConfig, num_microbatches: int = 1
    ) -> dict[str, float]:
        """One optimizer step on `batch` (this DP rank's rows of the global mini-batch)."""
        metrics = self.compute_gradients(batch, cfg, num_microbatches)
        ok, grad_norm, _ = self.optimizer.step()
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["update_ok"] = bool(ok)
        return metrics
