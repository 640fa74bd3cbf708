"""megatron-core's multi-tensor kernels, on torch's own where it has no fused ones.

megatron-core runs its optimizer's passes over every gradient or weight with apex's or
Transformer Engine's multi-tensor kernels. Without either (this project's CPU runs, and a
GPU without TE) it falls back to `megatron.core.utils`'s Python loops:
- `local_multi_tensor_l2_norm` (the clip's norm, and the norm every update logs) builds a
  Python list of the per-tensor norms and turns it into a tensor with `torch.tensor(list)`:
  a device-to-host copy, a host synchronisation, per gradient tensor, then one more for the
  total (qwen2.5-0.5b: ~171 per norm; the profile of an H200 window counted 175 host syncs
  in a plain step against the plain PyTorch step's 4, `bench/gpu_campaign/profile_16k.log`).
- `local_multi_tensor_scale` (the clip's scaling, and the copy of bf16 training's fp32
  master weights into the model's after every step) computes `src * scale` into a new
  tensor and copies it: two kernels and a temporary per tensor.

`device_l2_norm` is the same norm in one `torch._foreach_norm` over the list and a norm of
the stacked results, left on the device; `foreach_scale` the same product in one foreach
kernel (in place where source and destination are the same tensors, a foreach copy where
the scale is 1). `use_foreach_kernels()` puts them in place of those fallbacks only;
apex's and TE's kernels are left alone.
"""

from __future__ import annotations

import torch


def device_l2_norm(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: list[list[torch.Tensor]],
    per_tensor: bool,
    *args,
) -> tuple[torch.Tensor, None]:
    """The L2 norm of every tensor of `tensor_lists` together, as a float32 tensor of shape
    [1] on their device (the signature of apex's `multi_tensor_l2norm` as megatron's
    `multi_tensor_applier` calls it; `chunk_size` and `noop_flag` are the kernel's, unused).
    Per-tensor norms (`per_tensor`) are not asked for by megatron-core's clip: refused."""
    if per_tensor:
        raise NotImplementedError("device_l2_norm: per_tensor norms are not implemented")
    tensors = [t for tensor_list in tensor_lists for t in tensor_list]
    if not tensors:
        raise ValueError("device_l2_norm: no tensors (megatron-core only calls it with some)")
    # accumulated in float32 whatever the gradients' dtype, as apex's kernel does
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def foreach_scale(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: list[list[torch.Tensor]],
    scale: float,
) -> None:
    """dst = src * scale for each pair of `tensor_lists` = [srcs, dsts] (apex's
    `multi_tensor_scale` as megatron's `multi_tensor_applier` calls it, without its
    overflow flag, which megatron's own fallback leaves unset too). The product is taken in
    the source's dtype and rounded once into the destination's, as that fallback does."""
    srcs, dsts = tensor_lists
    if len(srcs) != len(dsts):
        raise ValueError(f"foreach_scale: {len(srcs)} sources for {len(dsts)} destinations")
    if not srcs:
        return
    if all(s is d for s, d in zip(srcs, dsts, strict=True)):
        torch._foreach_mul_(dsts, scale)
    elif scale == 1.0:
        torch._foreach_copy_(dsts, srcs)
    else:
        torch._foreach_copy_(dsts, torch._foreach_mul(srcs, scale))


def use_foreach_kernels() -> bool:
    """Put `device_l2_norm` and `foreach_scale` where megatron-core's clip and optimizer use
    its own fallbacks (no apex, no Transformer Engine). Returns whether they are in place;
    idempotent."""
    # why: megatron-core loads only in the processes that build its models
    from megatron.core import utils as megatron_utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as optimizer_mod

    if clip_grads.l2_norm_impl is megatron_utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = device_l2_norm
    # optimizer.py imported the scale by name too: both bindings
    for module in (clip_grads, optimizer_mod):
        if module.multi_tensor_scale_impl is megatron_utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = foreach_scale
    return clip_grads.l2_norm_impl is device_l2_norm and all(
        m.multi_tensor_scale_impl is foreach_scale for m in (clip_grads, optimizer_mod)
    )
