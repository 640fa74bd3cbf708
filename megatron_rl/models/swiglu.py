"""SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer", arXiv:2002.05202) as one autograd
function that saves only its input, for megatron-core's MLP.

Without activation fusion, megatron-core's MLP computes `silu(x1) * (x2 + glu_linear_offset)`
on the two halves of fc1's output with autograd's ops: the offset's sum (zero for Qwen and
Llama) is a pass of its own, backward ends in a concatenation of the halves' gradients, and
autograd saves silu(x1) and x2 + 0 beside fc1's output, which they came from: 5 ffn-sized
tensors per token and layer with fc2's input, where fc1's output (2) and fc2's input (1) are
all backward needs. For qwen2.5-0.5b in bf16 the 2 extra are 0.47 MB per token, 15 GB of a
32k-token sequence. With fusion asked for, megatron calls `bias_swiglu_impl`, which saves
only the input as well, but through `torch.compile` (Triton on CUDA, a C++ compiler on CPU).

`SwiGLU` computes the same forward in the same ops (silu(x1), then the product in place),
saves fc1's output alone, and in backward recomputes silu(x1) and writes both halves'
gradients straight into one [.., 2f] tensor: x2's as g * silu(x1), x1's as
silu_backward(g * x2, x1), the ops and roundings of megatron's unfused autograd.
`use_fused_swiglu()` puts it where megatron's MLP calls `bias_swiglu_impl` (the model's config
then asks for activation fusion, `models/gpt.py`); an fp8 input store or an activation
offload go to megatron's own function.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


class SwiGLU(torch.autograd.Function):
    """silu(x1) * x2 for x = [x1, x2] halves of the last dimension: x [..., 2f] -> [..., f]."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        gate, linear = x.chunk(2, dim=-1)
        ctx.save_for_backward(x)
        return F.silu(gate).mul_(linear)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        gate, linear = x.chunk(2, dim=-1)
        f = gate.shape[-1]
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        torch.mul(grad, F.silu(gate), out=out[..., f:])
        torch.ops.aten.silu_backward.grad_input(grad * linear, gate, grad_input=out[..., :f])
        return out


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """`SwiGLU` of x [..., 2f] -> [..., f]."""
    return SwiGLU.apply(x)


def _bias_swiglu(megatron_fn):
    """megatron's `bias_swiglu_impl` signature, taking the cases without an fp8 input store
    or an activation offload itself (a bias is added first, as megatron's does)."""

    def bias_swiglu_impl(input, bias, fp8_input_store=False, cpu_offload_input=False):  # noqa: A002
        if fp8_input_store or cpu_offload_input:
            return megatron_fn(input, bias, fp8_input_store, cpu_offload_input)
        return swiglu(input if bias is None else input + bias)

    functools.update_wrapper(bias_swiglu_impl, megatron_fn)
    bias_swiglu_impl.megatron_fn = megatron_fn
    return bias_swiglu_impl


def use_fused_swiglu() -> bool:
    """Route megatron-core's MLP's fused SwiGLU through `SwiGLU` (above). Returns whether it
    is in place; idempotent."""
    # why: megatron-core takes seconds to import: loaded on first use
    from megatron.core.transformer import mlp

    if not hasattr(mlp.bias_swiglu_impl, "megatron_fn"):
        mlp.bias_swiglu_impl = _bias_swiglu(mlp.bias_swiglu_impl)
    return hasattr(mlp.bias_swiglu_impl, "megatron_fn")
