"""The policy roles: ReferencePolicy (forward-only) and Actor (trains with PPO/VAPO losses).

The actor's loss for one micro-batch is PPO clip (clip-higher, optional dual clip) + mu *
positive-sample NLL - entropy bonus + beta * KL in the loss, every term normalised by the
global counts of the mini-batch (see `TrainableRole` for why that makes it exact).
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_rl.algorithms.kl import kl_estimate
from megatron_rl.algorithms.losses import (
    aggregate_loss,
    get_policy_loss_fn,
    positive_sample_nll_loss,
    token_mean,
)
from megatron_rl.data.batch import TrainingBatch, shift_to_tokens
from megatron_rl.models.gpt import MoEConfig, RecomputeConfig, build_gpt_model_chunks
from megatron_rl.models.lm_head import emit_hidden_states, output_weight
from megatron_rl.models.lora import adapters_disabled, apply_lora
from megatron_rl.models.router_replay import RouteReplay, RouterReplayConfig
from megatron_rl.models.source import ModelSource
from megatron_rl.parallel.vocab import chunked_logprobs_entropy
from megatron_rl.workers.losses_config import PolicyLossConfig
from megatron_rl.workers.optimizer import OptimConfig
from megatron_rl.workers.roles import MegatronRole, TrainableRole
from megatron_rl.workers.spec import RoleModel


def token_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    mb: TrainingBatch,
    vocab_size: int,
    temperature: float = 1.0,
    calculate_entropy: bool = True,
    keep_probs: bool = False,
    use_fused_kernels: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The last stage's hidden states ([B, S, h], or [1, T, h] packed) and the vocab-sharded
    projection [V/tp, h] -> the log-probs [B, S] of each token of `mb` given its prefix and
    the entropy of the distribution it was drawn from (None without `calculate_entropy`),
    aligned to tokens, under softmax(logits / temperature); the logits are made a tile at a
    time and never whole, their probabilities kept for backward with `keep_probs`, each
    tile's sums compiled with `use_fused_kernels` (`parallel.vocab.chunked_logprobs_entropy`)."""
    if mb.packing is not None:
        labels = mb.packing.next_tokens()
        to_tokens = mb.packing.to_tokens
    else:
        labels = torch.roll(mb.input_ids, -1, dims=1)  # the last column's label is never read

        def to_tokens(x):
            return shift_to_tokens(x[:, :-1])

    logprobs, entropy = chunked_logprobs_entropy(
        hidden,
        weight,
        labels,
        vocab_size,
        temperature,
        calculate_entropy=calculate_entropy,
        keep_probs=keep_probs,
        compiled_sums=use_fused_kernels,
    )
    return to_tokens(logprobs), None if entropy is None else to_tokens(entropy)


def _policy_chunks(model: RoleModel) -> list:
    chunks = build_gpt_model_chunks(
        model.arch, model.layout, model.precision, recompute=model.recompute, moe=model.moe
    )
    if model.model_path is not None:
        ModelSource(model.model_path).load_policy(chunks, model.arch)
    if model.lora is not None and model.lora.enabled:  # on the loaded base, before DDP
        apply_lora(chunks, model.lora)
    emit_hidden_states(chunks)  # the losses make logits a tile at a time (models/lm_head.py)
    return chunks


class _LogProbs:
    temperature: float = 1.0
    """The rollout's sampling temperature: every log-prob, KL and entropy of the policy is of
    softmax(logits / T), the distribution the samples were drawn from (verl and OpenRLHF
    divide the logits the same way). Top-p / top-k truncation is not applied here: the
    trainer's policy is the full tempered distribution, as in the anchors; the gap to what
    the engine sampled from is what `algorithm.rollout_correction` corrects."""

    use_fused_kernels: bool = False
    """The head's forward sums in one compiled kernel a tile (`RoleModel.use_fused_kernels`)."""

    router_replay: RouterReplayConfig = RouterReplayConfig()
    routing_metrics: dict[str, float] = {}
    """`routing/mismatch/*` of the last `compute_logprobs` that recorded routes (`router_replay.
    log_mismatch`), else {}."""

    def compute_logprobs(
        self, batch: TrainingBatch, num_microbatches: int = 1, max_tokens: int | None = None
    ) -> torch.Tensor:
        """Log-probs [B, S] of `batch.input_ids`, aligned to tokens, on every PP rank. Under
        routing replay (R3) the routers take the batch's routes; with `log_mismatch` they
        record their own, compared with the batch's (`routing_metrics`)."""
        vocab, t, fused = self.arch.vocab_size, self.temperature, self.use_fused_kernels
        record = self.router_replay.log_mismatch and batch.routed_experts is not None
        hooks = RouteReplay(self.chunks, record=True) if record else self.schedule_hooks(batch)

        def collect(mb, hidden):  # the last pipeline stage's
            weight = output_weight(self.chunks)
            return token_logprobs_entropy(
                hidden, weight, mb, vocab, t, calculate_entropy=False, use_fused_kernels=fused
            )[0]

        out = self.forward_collect(batch, num_microbatches, collect, max_tokens, hooks)
        self.routing_metrics = hooks.mismatch_metrics(self.arch.num_layers) if record else {}
        return out

    def schedule_hooks(self, batch: TrainingBatch):
        """R3: the routers replay the batch's routes (the engine's)."""
        if self.router_replay.mode != "R3":
            return None
        if batch.routed_experts is None:
            raise ValueError(
                "actor.router_replay.mode=R3 but the batch carries no routed_experts (the "
                "rollout engine did not record them)"
            )
        return RouteReplay(self.chunks)


class ReferencePolicy(_LogProbs, MegatronRole):
    """Forward-only copy of the policy: no optimizer state, no gradients.

    Build it only when a KL coefficient is > 0 (the trainer skips it entirely otherwise).
    """

    def __init__(self, model: RoleModel, *, temperature: float = 1.0):
        if model.recompute not in (None, RecomputeConfig()):
            # No backward pass: a recompute setting here would be silently ignored.
            raise ValueError(
                f"ReferencePolicy: RoleModel.recompute={model.recompute} but a reference "
                "runs forward only and never recomputes activations: leave recompute None"
            )
        chunks = _policy_chunks(model)
        for chunk in chunks:
            chunk.requires_grad_(False)
        super().__init__(
            arch=model.arch,
            layout=model.layout,
            chunks=chunks,
            precision=model.precision,
            use_remove_padding=model.use_remove_padding,
        )
        self.temperature = temperature
        self.use_fused_kernels = model.use_fused_kernels


class AdapterOffReference:
    """The reference policy of a LoRA actor: the actor's own chunks with the adapters
    switched off, which is the base model exactly (its weights are frozen), with no second
    copy of them (verl's LoRA reference; `models/lora.py`)."""

    offloaded_param_bytes = 0
    routing_metrics: dict[str, float] = {}

    def __init__(self, actor: Actor):
        self.actor = actor

    def compute_logprobs(
        self, batch: TrainingBatch, num_microbatches: int = 1, max_tokens: int | None = None
    ) -> torch.Tensor:
        with adapters_disabled(self.actor.chunks):
            return self.actor.compute_logprobs(batch, num_microbatches, max_tokens)

    def offload_params(self) -> None:
        raise ValueError(
            "the reference of a LoRA actor is the actor's base weights: there is nothing of "
            "its own to offload (actor.ref_param_offload)"
        )


class Actor(_LogProbs, TrainableRole):
    """The trained policy: DDP-wrapped chunks, megatron optimizer, PPO/VAPO losses."""

    def __init__(
        self,
        model: RoleModel,
        *,
        optim: OptimConfig | None = None,
        temperature: float = 1.0,
        router_replay: RouterReplayConfig | None = None,
        logits_checkpointing: bool = False,
    ):
        self.router_replay = router_replay or RouterReplayConfig()
        if self.router_replay.needs_routes:
            if not model.arch.is_moe:
                raise ValueError("actor.router_replay needs a mixture-of-experts model")
            moe = dataclasses.replace(model.moe or MoEConfig(), routing_replay=True)
            model = dataclasses.replace(model, moe=moe)
        super().__init__(
            arch=model.arch,
            layout=model.layout,
            chunks=_policy_chunks(model),
            precision=model.precision,
            optim=optim,
            use_remove_padding=model.use_remove_padding,
        )
        self.lora = model.lora if model.lora and model.lora.enabled else None
        """The adapters' settings (a checkpoint records them); None: every weight trains."""
        self.temperature = temperature
        self.use_fused_kernels = model.use_fused_kernels
        self.logits_checkpointing = logits_checkpointing
        """The head recomputes its logits in backward (`actor.logits_checkpointing`); else
        forward keeps their probabilities."""

    def loss(self, cfg: PolicyLossConfig, counts, mb: TrainingBatch, hidden):
        tokens, seqs, positive = counts
        mask = mb.response_mask
        logprobs, entropy = token_logprobs_entropy(
            hidden,
            output_weight(self.chunks),
            mb,
            self.arch.vocab_size,
            self.temperature,
            keep_probs=not self.logits_checkpointing,
            use_fused_kernels=self.use_fused_kernels,
        )
        advantages = mb.advantages
        if mb.rollout_is_weights is not None:
            # TIS: w > 0 times a token's clipped surrogate is the surrogate with w * A (both
            # arms of PPO's max, and dual clip's, scale by w; verl multiplies the per-token
            # loss). A policy loss registered here must keep that property.
            advantages = advantages * mb.rollout_is_weights
        pg_loss, metrics = get_policy_loss_fn(cfg.loss_mode)(
            logprobs, mb.old_logprobs, advantages, mask, cfg, tokens, seqs
        )
        loss = pg_loss
        metrics["pg_loss"] = pg_loss
        if cfg.nll_coef > 0:
            nll = positive_sample_nll_loss(logprobs, mask, mb.scores, positive)
            loss = loss + cfg.nll_coef * nll
            metrics["nll_loss"] = nll
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * aggregate_loss(
                entropy, mask, cfg.loss_agg_mode, tokens, seqs
            )
        if cfg.kl_loss_coef > 0:
            if mb.ref_logprobs is None:
                raise ValueError("kl_loss_coef > 0 needs ref_logprobs in the batch")
            kl = kl_estimate(logprobs, mb.ref_logprobs, cfg.kl_estimator)
            kl_loss = aggregate_loss(kl, mask, cfg.loss_agg_mode, tokens, seqs)
            loss = loss + cfg.kl_loss_coef * kl_loss
            metrics["kl_loss"] = kl_loss
        metrics["entropy"] = token_mean(entropy.detach(), mask, tokens)
        return loss, metrics
