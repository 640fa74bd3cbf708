"""Megatron's pipeline schedule around a role's model chunks.

Dataflow of one `run_schedule` call: the caller's micro-batches are fed to megatron's
`get_forward_backward_func` (no pipelining, 1F1B, or interleaved 1F1B); every PP stage reads
the same micro-batch iterator; only the last stage produces outputs and calls `loss_fn`;
outputs of a forward-only pass are broadcast from the last stage so every rank of the PP
group returns the same tensor. Micro-batches may differ in shape (token-budget micro-batches):
the stages then exchange each activation's shape before it (megatron-core's
`variable_seq_lengths`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from megatron_rl.data.batch import TrainingBatch
from megatron_rl.models.hf_mapping import unwrap
from megatron_rl.parallel import distributed


def run_schedule(
    chunks: list,
    micro_batches: list[TrainingBatch],
    loss_fn: Callable,
    *,
    forward_only: bool,
    collect_outputs: bool = False,
    hooks=None,
) -> list:
    """Run megatron's pipeline schedule over `micro_batches`.

    Training: `loss_fn(mb, output) -> (loss, metrics)`, returns the metrics of each
    micro-batch (last stage only). Collecting (`collect_outputs=True`, forward only):
    `loss_fn(mb, output) -> tensor`, returns those tensors (last stage only).
    `output` is the last stage's model output: hidden states [b, s, h] (the policy, see
    `models/lm_head.py`), logits [b, s, V/tp] or values [b, s, 1]; [1, T, ...] for a packed
    micro-batch (`data/packing.py`), whose rows the model reads back to back.
    `hooks`: `before_forward(mb, model)` / `after_forward(mb, model)` around each chunk's
    forward, `finish()` after the schedule (routing replay, `models/router_replay.py`).
    """
    # megatron loads only where it is used (CLI start-up, --help and config errors stay fast)
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    config = get_model_config(chunks[0])
    # MoE router losses (balancing, z-loss) count only the tokens the losses read
    router_losses = bool(config.num_moe_experts) and (
        config.moe_router_load_balancing_type != "none" or config.moe_z_loss_coeff is not None
    )

    def forward_step(data_iterator: Iterator[TrainingBatch], model):
        mb = next(data_iterator)
        kwargs = {"padding_mask": _moe_padding_mask(mb, model)} if router_losses else {}
        if hooks is not None:
            hooks.before_forward(mb, model)
        if mb.packing is not None:
            p = mb.packing
            kwargs["packed_seq_params"] = p.packed_seq_params()
            output = model(p.input_ids, p.position_ids, None, **kwargs)
        else:
            output = model(mb.input_ids, mb.position_ids, None, **kwargs)
        if hooks is not None:
            hooks.after_forward(mb, model)

        def loss_func(output_tensor, non_loss_data=False):
            return loss_fn(mb, output_tensor)

        return output, loss_func

    # Every stage of a PP group splits the same batch the same way, so they agree on this.
    shapes = {tuple(mb.model_input_ids.shape) for mb in micro_batches}
    config.variable_seq_lengths = len(shapes) > 1
    iterators = [iter(micro_batches) for _ in chunks]
    try:
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=chunks,
            num_microbatches=len(micro_batches),
            seq_length=micro_batches[0].model_input_ids.shape[1],
            micro_batch_size=micro_batches[0].model_input_ids.shape[0],
            forward_only=forward_only,
            collect_non_loss_data=collect_outputs,
        )
    finally:
        if hooks is not None:
            hooks.finish()


def _moe_padding_mask(mb: TrainingBatch, model) -> torch.Tensor:
    """[b, s] True at padding, for megatron-core 0.16.1's MoE router: its code reads True as
    padding (`~padding_mask` is what it keeps), whatever its docstrings say. GPTModel splits
    the mask over sequence-parallel ranks on the first pipeline stage only, so later stages
    get theirs split here."""
    mask = mb.padding_mask()
    unwrapped = unwrap(model)
    if unwrapped.config.sequence_parallel and not unwrapped.pre_process:
        # why: megatron-core takes seconds to import: loaded on first use
        from megatron.core import tensor_parallel

        split = tensor_parallel.scatter_to_sequence_parallel_region(mask.transpose(0, 1))
        mask = split.transpose(0, 1).contiguous()
    return mask


def broadcast_from_last_stage(parts: list[torch.Tensor], shape, dtype) -> torch.Tensor:
    """Concatenate the last stage's per-micro-batch outputs [b_i, s_i], each cut or
    zero-padded to shape[1] columns, and share the [B, S] result over the PP group."""
    # megatron loads only where it is used (CLI start-up, --help and config errors stay fast)
    from megatron.core import parallel_state

    if parallel_state.is_pipeline_last_stage():
        width = shape[1]
        out = torch.cat(
            [
                p[:, :width]
                if p.shape[1] >= width
                else torch.nn.functional.pad(p, (0, width - p.shape[1]))
                for p in parts
            ]
        ).to(dtype)
    else:
        out = torch.empty(shape, dtype=dtype, device=distributed.device())
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        torch.distributed.broadcast(
            out,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
    return out
