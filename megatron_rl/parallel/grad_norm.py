"""The gradient norm kept on the device where megatron-core has no fused kernel for it.

megatron-core takes the L2 norm of the gradients (the clip, and the norm every update logs)
with apex's or Transformer Engine's `multi_tensor_l2norm`. Without either (this project's CPU
runs, and a GPU without TE) it falls back to `megatron.core.utils.local_multi_tensor_l2_norm`,
which builds a Python list of the per-tensor norms and turns it into a tensor with
`torch.tensor(list)`: one device-to-host copy, a host synchronisation, per gradient tensor,
then one more for the total (qwen2.5-0.5b: ~171 per norm, two norms per update; the profile
of an H200 window counted 376-393 host syncs in one PPO update against the plain PyTorch
step's 4-5, `bench/gpu_campaign/profile_2k.log`). `device_l2_norm` is the same norm in one
`torch._foreach_norm` over the list and a norm of the stacked results, left on the device.
`use_device_l2_norm()` puts it in place of that fallback only; apex's and TE's kernels are
left alone.
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


def use_device_l2_norm() -> bool:
    """Put `device_l2_norm` where megatron-core's gradient clip uses its own fallback (no apex,
    no Transformer Engine). Returns whether it did; idempotent."""
    # why: megatron-core loads only in the processes that build its models
    from megatron.core import utils as megatron_utils
    from megatron.core.optimizer import clip_grads

    if clip_grads.l2_norm_impl is megatron_utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = device_l2_norm
    return clip_grads.l2_norm_impl is device_l2_norm
