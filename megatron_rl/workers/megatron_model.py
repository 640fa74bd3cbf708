"""What every Megatron role shares: the pipeline schedule around its model chunks, the DDP +
optimizer set-up of trainable roles, and export of parameters (or gradients) under Hugging
Face names.

Dataflow of one `run_schedule` call: the caller's micro-batches are fed to megatron's
`get_forward_backward_func` (no pipelining, 1F1B, or interleaved 1F1B); every PP stage reads
the same micro-batch iterator; only the last stage produces outputs and calls `loss_fn`;
outputs of a forward-only pass are broadcast from the last stage so every rank of the PP
group returns the same tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import torch

from megatron_rl.models.architecture import ModelArchitecture
from megatron_rl.models.gpt import PrecisionConfig, sequence_multiple
from megatron_rl.models.hf_mapping import hf_tensors_from_megatron
from megatron_rl.platform import ParallelLayout
from megatron_rl.workers.batch import TrainingBatch


@dataclass(frozen=True)
class OptimConfig:
    """AdamW through megatron's optimizer (VAPO: actor lr 1e-6, critic lr 2e-6)."""

    lr: float = 1e-6
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Global gradient-norm clip (over all TP/PP/DP shards)."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over DP (needs CUDA in megatron-core 0.16)."""


def wrap_ddp_and_optimizer(chunks: list, optim: OptimConfig):
    """Wrap chunks in megatron DDP and build the optimizer; returns (ddp_chunks, optimizer)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = chunks[0].config
    if optim.use_distributed_optimizer and not torch.cuda.is_available():
        raise ValueError(
            "use_distributed_optimizer=True needs CUDA: megatron-core's distributed optimizer "
            "refuses CPU tensors; use it on GPU or set it to False"
        )
    if config.bf16 and not torch.cuda.is_available():
        raise ValueError("bf16 training needs CUDA (megatron's bf16 optimizer); use fp32 on CPU")
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=optim.use_distributed_optimizer,
    )
    wrapped = [
        DistributedDataParallel(
            config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0
        )
        for i, chunk in enumerate(chunks)
    ]
    config.finalize_model_grads_func = finalize_model_grads
    no_sync = [c.no_sync for c in wrapped]
    config.no_sync_func = no_sync if len(no_sync) > 1 else no_sync[0]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=optim.lr,
            weight_decay=optim.weight_decay,
            adam_beta1=optim.adam_beta1,
            adam_beta2=optim.adam_beta2,
            adam_eps=optim.adam_eps,
            clip_grad=optim.clip_grad,
            bf16=config.bf16,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=optim.use_distributed_optimizer,
        ),
        wrapped,
        # platform.initialize builds megatron's extra gloo groups only next to NCCL.
        use_gloo_process_groups=torch.cuda.is_available(),
    )
    return wrapped, optimizer


def run_schedule(
    chunks: list,
    micro_batches: list[TrainingBatch],
    loss_fn: Callable,
    *,
    forward_only: bool,
    collect_outputs: bool = False,
) -> list:
    """Run megatron's pipeline schedule over `micro_batches`.

    Training: `loss_fn(mb, output) -> (loss, metrics)`, returns the metrics of each
    micro-batch (last stage only). Collecting (`collect_outputs=True`, forward only):
    `loss_fn(mb, output) -> tensor`, returns those tensors (last stage only).
    `output` is the last stage's model output: logits [b, s, V/tp] or values [b, s, 1].
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator: Iterator[TrainingBatch], model):
        mb = next(data_iterator)
        output = model(mb.input_ids, mb.position_ids, None)

        def loss_func(output_tensor, non_loss_data=False):
            return loss_fn(mb, output_tensor)

        return output, loss_func

    iterators = [iter(micro_batches) for _ in chunks]
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks,
        num_microbatches=len(micro_batches),
        seq_length=micro_batches[0].seq_length,
        micro_batch_size=len(micro_batches[0]),
        forward_only=forward_only,
        collect_non_loss_data=collect_outputs,
    )


def broadcast_from_last_stage(parts: list[torch.Tensor], shape, dtype) -> torch.Tensor:
    """Concatenate the last stage's per-micro-batch outputs and share them over the PP group."""
    from megatron.core import parallel_state

    if parallel_state.is_pipeline_last_stage():
        out = torch.cat(parts).to(dtype)
    else:
        out = torch.empty(shape, dtype=dtype)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        torch.distributed.broadcast(
            out,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
    return out


def shift_to_tokens(per_position: torch.Tensor) -> torch.Tensor:
    """[B, S-1] values computed at positions 0..S-2 about tokens 1..S-1 -> [B, S] aligned to
    tokens (entry 0, the first prompt token, is 0)."""
    return torch.nn.functional.pad(per_position, (1, 0))


def unwrap(chunk):
    """The GPTModel inside a DDP wrapper (or the chunk itself)."""
    return getattr(chunk, "module", chunk)


def export_hf_tensors(
    chunks: list, arch: ModelArchitecture, *, grads: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for this rank's pipeline stage, TP shards gathered.

    grads=True yields the reduced gradients (DDP's main_grad) instead of the weights. A
    critic's value head is yielded as `score.weight`, as in HF sequence classification.
    Every TP rank of the stage yields the same tensors.
    """
    from megatron.core import parallel_state

    from megatron_rl.models.critic import ValueHead
    from megatron_rl.models.gpt import layer_offset

    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group()
    for chunk in chunks:
        model = unwrap(chunk)
        offset = layer_offset(model)
        for name, param in model.named_parameters():
            tensor = param.main_grad if grads else param.detach()
            if name == "output_layer.weight" and isinstance(model.output_layer, ValueHead):
                yield "score.weight", tensor.clone()
                continue
            if getattr(param, "tensor_model_parallel", False) and tp_size > 1:
                shards = [torch.empty_like(tensor) for _ in range(tp_size)]
                torch.distributed.all_gather(shards, tensor.contiguous(), group=group)
            else:
                shards = [tensor]
            yield from hf_tensors_from_megatron(name, shards, arch, offset).items()


BATCH_SHARES = frozenset({
    "pg_loss", "nll_loss", "kl_loss", "value_loss",
    "entropy", "ppo_kl", "pg_clipfrac", "pg_clipfrac_low", "pg_clipfrac_high",
    "pg_clipfrac_lower", "vf_clipfrac",
})  # fmt: skip
"""Metrics a loss function returns as one micro-batch's share of a statistic normalised over
the whole DP-global mini-batch (global token or sequence counts): the losses, and token means
(`algorithms.losses.token_mean`). Summed over micro-batches and DP ranks they are the
mini-batch's loss or mean, the numbers verl and OpenRLHF log."""


def data_parallel_sum(t: torch.Tensor) -> torch.Tensor:
    """All-reduce (SUM) over the data-parallel group; identity with one DP rank."""
    from megatron.core import parallel_state

    if parallel_state.get_data_parallel_world_size() > 1:
        torch.distributed.all_reduce(t, group=parallel_state.get_data_parallel_group())
    return t


class MegatronRole:
    """Model chunks of one role plus forward-only evaluation over a batch."""

    def __init__(
        self,
        arch: ModelArchitecture,
        layout: ParallelLayout,
        chunks: list,
        precision: PrecisionConfig | None = None,
    ):
        self.arch, self.layout, self.chunks = arch, layout, chunks
        self.seq_multiple = sequence_multiple(layout, precision)

    @torch.no_grad()
    def forward_collect(
        self, batch: TrainingBatch, num_microbatches: int, collect: Callable
    ) -> torch.Tensor:
        """`collect(mb, output) -> [b, S']` on each micro-batch; [B, S] on every PP rank."""
        for chunk in self.chunks:
            chunk.eval()
        padded = batch.padded_to_multiple(self.seq_multiple)
        parts = run_schedule(
            self.chunks,
            padded.split(num_microbatches),
            collect,
            forward_only=True,
            collect_outputs=True,
        )
        out = broadcast_from_last_stage(parts, padded.input_ids.shape, torch.float32)
        return out[:, : batch.seq_length]


class TrainableRole(MegatronRole):
    """A role with DDP-wrapped chunks and an optimizer; subclasses define `loss`.

    Token-level normalisation across micro-batches and DP ranks: the global counts of the
    whole mini-batch are all-reduced over DP once (`counts`), each micro-batch's loss terms
    divide by them, and the total is multiplied by num_microbatches * dp_size, which
    megatron's average over micro-batches and DDP's average over ranks cancel. The gradient
    is then exactly that of the global batch, however it is split.
    """

    def __init__(self, arch, layout, chunks, precision=None, optim: OptimConfig | None = None):
        wrapped, self.optimizer = wrap_ddp_and_optimizer(chunks, optim or OptimConfig())
        super().__init__(arch, layout, wrapped, precision)

    def loss(self, cfg, counts: torch.Tensor, mb: TrainingBatch, output):
        """(loss normalised by the global `counts`, metrics) for one micro-batch."""
        raise NotImplementedError

    def _scaled_loss(self, cfg, counts, scale, mb, output):
        loss, metrics = self.loss(cfg, counts, mb, output)
        # megatron divides the returned loss in place; metrics must not share its storage.
        return loss * scale, {k: v.detach().clone() for k, v in metrics.items()}

    def compute_gradients(
        self, batch: TrainingBatch, cfg, num_microbatches: int = 1
    ) -> dict[str, float]:
        """Zero, then accumulate this DP rank's share of the global-batch gradient into DDP's
        main_grad (reduced over DP, and over TP for sequence-parallel norms). Returns the
        metrics on the last pipeline stage ({} elsewhere): the BATCH_SHARES of the
        whole DP-global batch, the same on every DP rank; the rest averaged over micro-batches."""
        from megatron.core import parallel_state

        for chunk in self.chunks:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        counts = data_parallel_sum(global_counts(batch))
        scale = num_microbatches * parallel_state.get_data_parallel_world_size()
        metrics = run_schedule(
            self.chunks,
            batch.padded_to_multiple(self.seq_multiple).split(num_microbatches),
            partial(self._scaled_loss, cfg, counts, scale),
            forward_only=False,
        )
        if not metrics:
            return {}
        out = {k: torch.stack([m[k] for m in metrics]).double() for k in metrics[0]}
        shares = [k for k in out if k in BATCH_SHARES]
        if shares:  # every rank of a DP group is the same pipeline stage: all call this
            totals = data_parallel_sum(torch.stack([out[k].sum() for k in shares]))
            out.update(zip(shares, totals, strict=True))
        return {k: (v if k in BATCH_SHARES else v.nanmean()).item() for k, v in out.items()}

    def update(self, batch: TrainingBatch, cfg, num_microbatches: int = 1) -> dict[str, float]:
        """One optimizer step on `batch` (this DP rank's rows of the global mini-batch)."""
        metrics = self.compute_gradients(batch, cfg, num_microbatches)
        # A NaN/Inf anywhere makes the global grad norm non-finite on every rank (it is
        # reduced over TP/PP/DP): skip the step everywhere rather than poison the weights.
        self.optimizer.prepare_grads()  # DDP's main_grad -> param.grad, what the norm reads
        norm = float(self.optimizer.get_grad_norm())
        if not math.isfinite(norm):
            self.optimizer.zero_grad()
            metrics.update(grad_norm=norm, update_ok=False, skipped_nonfinite=1.0)
            return metrics
        ok, grad_norm, _ = self.optimizer.step()
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else norm
        metrics["update_ok"] = bool(ok)
        metrics["skipped_nonfinite"] = 0.0
        return metrics


def global_counts(batch: TrainingBatch) -> torch.Tensor:
    """[3] float64 on this rank: valid tokens, non-empty sequences, positive-sample tokens."""
    from megatron_rl.algorithms.losses import token_and_sequence_counts

    positive = torch.zeros((), dtype=torch.float64)
    if batch.scores is not None:
        positive = (batch.response_mask.bool() & (batch.scores > 0)[:, None]).sum().double()
    return torch.cat([token_and_sequence_counts(batch.response_mask), positive[None]])
