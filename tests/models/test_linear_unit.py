"""Unit tier: megatron-core's tensor-parallel linears as `F.linear` where they communicate
nothing (`megatron_rl.models.linear`), against megatron-core's own functions."""

import types

import pytest
import torch

from megatron_rl.models.linear import _identity_on_one_rank, _plain_linear, use_plain_linear
from tests.tolerances import FP32_MODEL, assert_close

S, B, IN, OUT = 6, 3, 16, 24


def _device():
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _leaves(bias: bool, frozen: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S, B, IN, generator=g).to(_device()).requires_grad_(True)
    w = (torch.randn(OUT, IN, generator=g) / IN**0.5).to(_device()).requires_grad_(not frozen)
    b = torch.randn(OUT, generator=g).to(_device()).requires_grad_(True) if bias else None
    return x, w, b


def _megatron_fns():
    # why: megatron-core takes seconds to import: loaded in the test that needs it
    from megatron.core.tensor_parallel import layers

    use_plain_linear()
    return {
        False: layers.linear_with_grad_accumulation_and_async_allreduce.megatron_fn,
        True: layers.linear_with_frozen_weight.megatron_fn,
    }


def _no_communication(tp_group):
    """The keywords megatron's layers pass where the product communicates nothing."""
    return dict(
        gradient_accumulation_fusion=False,
        allreduce_dgrad=False,
        sequence_parallel=False,
        tp_group=tp_group,
        grad_output_buffer=None,
    )


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("frozen", [False, True])
def test_plain_product_equals_megatrons_in_value_and_gradients(world_of_one, bias, frozen):
    megatron_fn = _megatron_fns()[frozen]
    kwargs = _no_communication(torch.distributed.group.WORLD)
    outs, grads = [], []
    for fn in (_plain_linear(megatron_fn, bias_grad=not frozen), megatron_fn):
        x, w, b = _leaves(bias, frozen)
        y = fn(input=x, weight=w, bias=b, **kwargs)
        upstream = torch.linspace(-1, 1, y.numel(), device=y.device).view_as(y)
        y.backward(upstream)
        outs.append(y.detach())
        grads.append([t.grad for t in (x, w, b) if t is not None])
    assert_close(outs[0].cpu(), outs[1].cpu(), FP32_MODEL)
    # a frozen weight's bias gets no gradient from megatron's function: none from ours
    assert [g is None for g in grads[0]] == [g is None for g in grads[1]]
    assert [g is None for g in grads[0]] == [False, frozen, frozen][: 2 + bias]
    for ours, theirs in zip(*grads, strict=True):
        if theirs is not None:
            assert_close(ours.cpu(), theirs.cpu(), FP32_MODEL)


@pytest.mark.parametrize(
    "change",
    [
        {"allreduce_dgrad": True},
        {"sequence_parallel": True},
        {"gradient_accumulation_fusion": True},
        {"grad_output_buffer": []},
    ],
)
def test_a_product_that_communicates_or_fuses_goes_to_megatron(change):
    calls = []

    def megatron_fn(input, weight, bias, **kwargs):  # noqa: A002 - megatron's keyword
        calls.append(kwargs)
        return "megatron's"

    kwargs = {**_no_communication(None), **change}
    x, w, b = _leaves(bias=True, frozen=False)
    assert _plain_linear(megatron_fn)(input=x, weight=w, bias=b, **kwargs) == "megatron's"
    assert calls == [kwargs]
    assert not isinstance(_plain_linear(megatron_fn)(x, w, b, **_no_communication(None)), str)


def test_mappings_are_the_identity_on_one_rank_only():
    calls = []

    def megatron_fn(input_, group=None):
        calls.append(group)
        return input_.clone()

    mapping = _identity_on_one_rank(megatron_fn)
    x = torch.ones(2, device=_device())
    one, two = (types.SimpleNamespace(size=lambda n=n: n) for n in (1, 2))
    assert mapping(x, group=one) is x and calls == []
    assert mapping(x, group=two) is not x and calls == [two]
    assert mapping(x) is not x and calls == [two, None]  # megatron finds its own group


def test_megatron_layers_look_up_the_routes_once():
    # why: megatron-core takes seconds to import: loaded in the test that needs it
    from megatron.core.tensor_parallel import layers, mappings

    assert use_plain_linear() is True
    first = layers.linear_with_grad_accumulation_and_async_allreduce
    assert use_plain_linear() is True  # idempotent: wraps megatron's functions once
    assert layers.linear_with_grad_accumulation_and_async_allreduce is first
    assert first.megatron_fn.__module__ == layers.__name__
    for name in (
        "copy_to_tensor_model_parallel_region",
        "reduce_from_tensor_model_parallel_region",
    ):
        assert getattr(layers, name).megatron_fn is getattr(mappings, name)
