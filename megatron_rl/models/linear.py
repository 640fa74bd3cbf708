"""megatron-core's tensor-parallel linears as one `F.linear` where they communicate nothing.

Without Transformer Engine, megatron-core's `ColumnParallelLinear` and `RowParallelLinear`
run every projection through Python autograd functions written for tensor and sequence
parallelism: `copy_to_tensor_model_parallel_region` before a column-parallel layer,
`LinearWithGradAccumulationAndAsyncCommunication` (or `LinearWithFrozenWeight` for a frozen
weight) for the product, `reduce_from_tensor_model_parallel_region` after a row-parallel
one. Where the product neither all-reduces its input's gradient nor gathers a sequence nor
fuses gradient accumulation (every layer on one tensor-parallel rank; a row-parallel layer's
product on any number), it is a plain product, and on one rank the two mappings are the
identity; yet each costs a Python call forward and backward, and the product adds its bias
in a pass of its own. That host time is what a short step spends: on the 2-core CPU an
update at 2 x 8 tokens ran 1.14x faster without it (docs/performance.md); on a GPU it is
time the device waits for the host.

`use_plain_linear()` routes those cases to `torch.nn.functional.linear` (the bias inside the
GEMM, autograd's own backward, the same weight gradient in `param.grad` for megatron's DDP
hooks to accumulate into `main_grad`) and the mappings of a one-rank group to the identity.
Every other case (a column-parallel product under tensor or sequence parallelism,
gradient-accumulation fusion, a deferred embedding weight gradient, a mapping over more than
one rank) goes to megatron-core's own function unchanged.
"""

from __future__ import annotations

import functools

import torch


def _plain_linear(megatron_fn, bias_grad: bool = True):
    """megatron's linear implementation (`linear_with_grad_accumulation_and_async_allreduce`,
    or with `bias_grad=False` `linear_with_frozen_weight`, whose backward gives the bias no
    gradient either), taking the case with nothing to communicate or fuse itself. The layers'
    `_forward_impl` passes everything after the weight by keyword."""

    def linear(input, weight, bias=None, **kwargs):  # noqa: A002 - megatron's keyword
        parallel = (
            kwargs.get("allreduce_dgrad")
            or kwargs.get("sequence_parallel")
            or kwargs.get("gradient_accumulation_fusion")
            or kwargs.get("grad_output_buffer") is not None
        )
        if parallel:
            return megatron_fn(input, weight, bias, **kwargs)
        if bias is not None and not bias_grad:
            bias = bias.detach()
        return torch.nn.functional.linear(input, weight, bias)

    return _wrapping(linear, megatron_fn)


def _identity_on_one_rank(megatron_fn):
    """A TP mapping (`copy_to_...` / `reduce_from_tensor_model_parallel_region`), the
    identity where its group has one rank (what megatron's own computes there, each way)."""

    def mapping(input_, group=None):
        if group is not None and group.size() == 1:
            return input_
        return megatron_fn(input_, group=group)

    return _wrapping(mapping, megatron_fn)


def _wrapping(route, megatron_fn):
    """`route` standing in for `megatron_fn` under its name, its attributes included:
    megatron's function reads and sets its own (`.warned`) through the module's name, which
    is then the route's."""
    functools.update_wrapper(route, megatron_fn)
    route.megatron_fn = megatron_fn
    return route


_ROUTES = {
    "linear_with_grad_accumulation_and_async_allreduce": _plain_linear,
    "linear_with_frozen_weight": functools.partial(_plain_linear, bias_grad=False),
    "copy_to_tensor_model_parallel_region": _identity_on_one_rank,
    "reduce_from_tensor_model_parallel_region": _identity_on_one_rank,
}
ROUTED = tuple(_ROUTES)
"""The names in `megatron.core.tensor_parallel.layers` that `use_plain_linear` routes."""


def use_plain_linear() -> bool:
    """Route megatron-core's tensor-parallel layers' products and mappings as above (in
    `megatron.core.tensor_parallel.layers`, where the layers look them up). Returns whether
    they are in place; idempotent."""
    # why: megatron-core takes seconds to import: loaded on first use
    from megatron.core.tensor_parallel import layers

    for name, route in _ROUTES.items():
        fn = getattr(layers, name)
        if not hasattr(fn, "megatron_fn"):
            setattr(layers, name, route(fn))
    return all(hasattr(getattr(layers, name), "megatron_fn") for name in ROUTED)
