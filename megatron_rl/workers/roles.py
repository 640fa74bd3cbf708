"""What every Megatron role shares: forward-only evaluation of a batch over its model chunks
(`MegatronRole`), and for trainable roles the DDP + optimizer step with token-level
normalisation over micro-batches and data-parallel ranks (`TrainableRole`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch

from megatron_rl.data.batch import TrainingBatch, split_micro_batches
from megatron_rl.models.architecture import ModelArchitecture
from megatron_rl.models.gpt import PrecisionConfig, sequence_multiple
from megatron_rl.parallel import distributed
from megatron_rl.parallel.collectives import (
    data_parallel_max,
    data_parallel_sum,
    global_token_counts,
)
from megatron_rl.parallel.distributed import ParallelLayout
from megatron_rl.workers.offload import ParamOffload
from megatron_rl.workers.optimizer import (
    OptimConfig,
    current_lr,
    step_with_grad_norm,
    use_fused_adamw,
    wrap_ddp_and_optimizer,
)
from megatron_rl.workers.rewind import UpdateSnapshot
from megatron_rl.workers.router_losses import router_loss_metrics
from megatron_rl.workers.schedule import broadcast_from_last_stage, run_schedule

BATCH_SHARES = frozenset({
    "pg_loss", "nll_loss", "kl_loss", "vf_loss",
    "entropy", "ppo_kl", "pg_clipfrac", "pg_clipfrac_low", "pg_clipfrac_high",
    "pg_clipfrac_lower", "vf_clipfrac",
})  # fmt: skip
"""Metrics a loss function returns as one micro-batch's share of a statistic normalised over
the whole DP-global mini-batch (global token or sequence counts): the losses, and token means
(`algorithms.losses.token_mean`). Summed over micro-batches and DP ranks they are the
mini-batch's loss or mean, the numbers verl and OpenRLHF log."""


def set_training(chunks: list, mode: bool) -> None:
    """`train(mode)` on each of `chunks` whose own flag differs. The call sets the flag of
    every submodule one by one (370 modules for a 24-layer model: 0.8 ms of host time on the
    2-core CPU, per update and per forward pass); a chunk's flag says what its last
    `train(mode)` set, since nothing here sets a submodule's alone."""
    for chunk in chunks:
        if chunk.training != mode:
            chunk.train(mode)


def _max_over_data_parallel(count: int) -> int:
    return int(data_parallel_max(torch.tensor([count], device=distributed.device())).item())


class MegatronRole:
    """Model chunks of one role plus forward-only evaluation over a batch."""

    def __init__(
        self,
        *,
        arch: ModelArchitecture,
        layout: ParallelLayout,
        chunks: list,
        precision: PrecisionConfig | None = None,
        use_remove_padding: bool = False,
    ):
        if use_remove_padding and arch.is_moe:
            raise ValueError(
                "model.use_remove_padding (packed micro-batches) is not supported for "
                "mixture-of-experts models yet: set it to false"
            )
        self.use_remove_padding = use_remove_padding
        """Micro-batches run packed, their rows back to back with no padding
        (`data/packing.py`; verl's name)."""
        self.arch, self.layout, self._chunks = arch, layout, chunks
        self._params_away = ParamOffload()
        self.seq_multiple = sequence_multiple(layout, precision)
        # megatron's interleaved 1F1B takes micro-batches in groups of the pipeline size
        interleaved = layout.virtual_pipeline_model_parallel_size is not None
        self.count_multiple = layout.pipeline_model_parallel_size if interleaved else 1

    @property
    def chunks(self) -> list:
        """The model chunks, their parameters on the device: whoever reads them (a forward,
        the weight sync, a checkpoint) first brings back parameters `offload_params` moved
        to host memory; reading them while away would be undefined."""
        self.restore_params()
        return self._chunks

    @property
    def device(self) -> torch.device:
        """Where this role's weights live: every batch it is given moves here first."""
        return next(self._chunks[0].parameters()).device

    @property
    def offloaded_param_bytes(self) -> int:
        """Bytes of parameters in host memory now (0 while they are on the device)."""
        return self._params_away.nbytes if self._params_away.offloaded else 0

    def offload_params(self) -> None:
        """Move the parameters to host memory until the chunks' next use (`param_offload`;
        `workers/offload.py`): the device memory they held is free for the rollout engine."""
        self._params_away.offload(self._chunks)

    def restore_params(self) -> None:
        self._params_away.restore()

    def schedule_hooks(self, batch: TrainingBatch):
        """Hooks around each forward of a gradient pass (`run_schedule`); none here."""
        return None

    def split(self, batch: TrainingBatch, num_microbatches: int, max_tokens: int | None):
        # With expert parallelism every micro-batch's MoE layers exchange tokens with the
        # other data-parallel ranks: a rank whose token budget made fewer micro-batches
        # would leave the others waiting in an all-to-all. All run the largest count.
        agree = _max_over_data_parallel if self.layout.expert_model_parallel_size > 1 else None
        return split_micro_batches(
            batch,
            num_microbatches,
            max_tokens,
            self.seq_multiple,
            self.count_multiple,
            agree,
            pack=self.use_remove_padding,
        )

    @torch.no_grad()
    def forward_collect(
        self,
        batch: TrainingBatch,
        num_microbatches: int,
        collect: Callable,
        max_tokens: int | None = None,
        hooks=None,
    ) -> torch.Tensor:
        """`collect(mb, output) -> [b, s]` on each micro-batch; [B, S] on every PP rank, in the
        batch's row order, on the role's device. With a token budget (`max_tokens`, see
        `split_micro_batches`) the entries past a row's last response token are 0: its
        micro-batch held padding there, or stopped before."""
        batch = batch.to(self.device)
        set_training(self.chunks, False)
        micro, order = self.split(batch, num_microbatches, max_tokens)
        parts = run_schedule(
            self.chunks, micro, collect, forward_only=True, collect_outputs=True, hooks=hooks
        )
        out = broadcast_from_last_stage(parts, batch.input_ids.shape, torch.float32)
        if order is None:
            return out
        in_batch_order = torch.empty_like(out)
        in_batch_order[order] = out
        # Past a row's length its micro-batch held padding (or stopped): 0, whatever the split.
        seen = torch.arange(batch.seq_length, device=out.device) < batch.sequence_lengths()[:, None]
        return torch.where(seen, in_batch_order, 0.0)


class TrainableRole(MegatronRole):
    """A role with DDP-wrapped chunks and an optimizer; subclasses define `loss`.

    Token-level normalisation across micro-batches and DP ranks: the global counts of the
    whole mini-batch are all-reduced over DP once (`counts`), each micro-batch's loss terms
    divide by them, and the total is multiplied by num_microbatches * dp_size, which
    megatron's average over micro-batches and DDP's average over ranks cancel. The gradient
    is then exactly that of the global batch, however it is split.
    """

    def __init__(
        self,
        *,
        arch: ModelArchitecture,
        layout: ParallelLayout,
        chunks: list,
        precision: PrecisionConfig | None = None,
        optim: OptimConfig | None = None,
        use_remove_padding: bool = False,
    ):
        self.optim = optim or OptimConfig()
        wrapped, self.optimizer, self.scheduler = wrap_ddp_and_optimizer(chunks, self.optim)
        super().__init__(
            arch=arch,
            layout=layout,
            chunks=wrapped,
            precision=precision,
            use_remove_padding=use_remove_padding,
        )
        self.offloaded: set[str] = set()
        self.update_snapshot = UpdateSnapshot()
        """Where the step's updates can be rewound to (`snapshot_updates`)."""

    def offload(self, grads: bool = False, optimizer: bool = False, params: bool = False) -> None:
        """Free memory for the rollout engine until the next update (megatron-core's RL
        hooks; verl's grad_offload / optimizer_offload / param_offload): `grads` releases the
        storage of the DDP gradient buffers (every main_grad view stays valid and is
        re-allocated zeroed), `optimizer` moves the optimizer's state and master weights to
        host memory, `params` the parameters (`offload_params`). The next
        `compute_gradients` brings back whatever is away; any use of `chunks`, the params."""
        on_gpu = torch.cuda.is_available()
        if grads and "grads" not in self.offloaded:
            for chunk in self._chunks:
                chunk.offload_grad_buffers(synchronize=on_gpu, empty_cache=on_gpu)
            self.offloaded.add("grads")
        if optimizer and "optimizer" not in self.offloaded:
            self.optimizer.offload_to_cpu()
            self.offloaded.add("optimizer")
        if params:
            self.offload_params()

    def restore_offloaded(self) -> None:
        """Bring back whatever `offload` moved (before an update, or a checkpoint's load)."""
        self.restore_params()
        if "grads" in self.offloaded:
            for chunk in self._chunks:
                chunk.restore_grad_buffers(synchronize=torch.cuda.is_available())
        if "optimizer" in self.offloaded:
            self.optimizer.restore_from_cpu()
            use_fused_adamw(self.optimizer)  # megatron brings every step count to the device
        self.offloaded.clear()

    def snapshot_updates(self) -> None:
        """Copy the weights, optimizer state and schedule to host memory (`workers/rewind.py`):
        `rewind_updates` puts them back, undoing every optimizer step taken since."""
        self.update_snapshot.take(self.chunks, self.optimizer, self.scheduler)

    def rewind_updates(self) -> None:
        self.update_snapshot.restore(self.chunks, self.optimizer, self.scheduler)

    def loss(self, cfg, counts: torch.Tensor, mb: TrainingBatch, output):
        """(loss normalised by the global `counts`, metrics) for one micro-batch."""
        raise NotImplementedError

    def _scaled_loss(self, cfg, counts, scale, mb, output):
        loss, metrics = self.loss(cfg, counts, mb, output)
        # megatron divides the returned loss in place; metrics must not share its storage.
        return loss * scale, {k: v.detach().clone() for k, v in metrics.items()}

    def compute_gradients(
        self,
        batch: TrainingBatch,
        cfg,
        num_microbatches: int = 1,
        max_tokens: int | None = None,
    ) -> dict[str, float]:
        """Zero, then accumulate this DP rank's share of the global-batch gradient into DDP's
        main_grad (reduced over DP, and over TP for sequence-parallel norms). Returns the
        metrics on the last pipeline stage ({} elsewhere): the BATCH_SHARES of the
        whole DP-global batch, the same on every DP rank; the rest averaged over micro-batches.
        `max_tokens`: micro-batches by token budget instead of `num_microbatches` equal ones
        (`split_micro_batches`); the counts are the batch's, so the gradient is the same."""
        # megatron loads only where it is used (CLI start-up, --help and config errors stay fast)
        from megatron.core import parallel_state

        self.restore_offloaded()
        batch = batch.to(self.device)
        set_training(self.chunks, True)
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        counts = global_token_counts(batch.response_mask, batch.scores)
        micro, _ = self.split(batch, num_microbatches, max_tokens)
        # Megatron averages over this rank's micro-batches and DDP over DP ranks; the
        # scale undoes both, whatever number of micro-batches each rank runs.
        scale = len(micro) * parallel_state.get_data_parallel_world_size()
        metrics = run_schedule(
            self.chunks,
            micro,
            partial(self._scaled_loss, cfg, counts, scale),
            forward_only=False,
            hooks=self.schedule_hooks(batch),
        )
        router = router_loss_metrics(len(micro), self.arch.num_layers) if self.arch.is_moe else {}
        if not metrics:
            return {}
        out = {k: torch.stack([m[k] for m in metrics]).double() for k in metrics[0]}
        shares = [k for k in out if k in BATCH_SHARES]
        if shares:  # every rank of a DP group is the same pipeline stage: all call this
            totals = data_parallel_sum(torch.stack([out[k].sum() for k in shares]))
            out.update(zip(shares, totals, strict=True))
        # one copy to the host for all of them (a GPU waits once, not once per metric)
        values = torch.stack([v if k in BATCH_SHARES else v.nanmean() for k, v in out.items()])
        out = dict(zip(out, values.tolist(), strict=True))
        out["micro_batches"] = float(len(micro))  # this rank's, token budgets make it vary
        return {**out, **router}

    def update(
        self,
        batch: TrainingBatch,
        cfg,
        num_microbatches: int = 1,
        max_tokens: int | None = None,
    ) -> dict[str, float]:
        """One optimizer step on `batch` (this DP rank's rows of the global mini-batch)."""
        return self.apply_gradients(
            self.compute_gradients(batch, cfg, num_microbatches, max_tokens)
        )

    def apply_gradients(self, metrics: dict[str, float]) -> dict[str, float]:
        """The optimizer step on what `compute_gradients` accumulated (its `metrics`, which
        come back with the step's added). Apart, so that a trainer can hold several roles'
        gradients before it changes any weight (a stop request can still abort then)."""
        metrics["lr"] = current_lr(self.optimizer)  # this update's, before the schedule moves
        # A NaN/Inf anywhere makes the global grad norm non-finite on every rank (it is
        # reduced over TP/PP/DP): skip the step everywhere rather than poison the weights.
        found_inf = self.optimizer.prepare_grads()  # DDP's main_grad -> param.grad
        norm = float(self.optimizer.get_grad_norm())
        if found_inf or not math.isfinite(norm):
            self.optimizer.zero_grad()
            metrics.update(grad_norm=norm, update_ok=False, skipped_nonfinite=1.0)
            return metrics
        ok = step_with_grad_norm(self.optimizer, norm)  # clipped to this norm, not a second
        if ok:  # as megatron-LM: a skipped update does not advance the schedule
            self.scheduler.step(1)
        metrics["grad_norm"] = norm
        metrics["update_ok"] = bool(ok)
        metrics["skipped_nonfinite"] = 0.0
        return metrics
