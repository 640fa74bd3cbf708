"""Unit tier: the decoder layer's forward in the calls its maths needs (`models/layer.py`):
its residual sums against megatron-core's bias-dropout-add at dropout 0, and the calls it
leaves to megatron-core's own forward. Whole layers, ours against megatron's to the bit at
TP2+SP, PP2, DP2, packed and in eval mode: `tests/models/test_core_attention_distributed.py`."""

import types

import pytest
import torch

from megatron_rl.models.layer import _add_residual, _lean_forward, use_lean_layer


def _tensors(bias: bool, residual_dtype, requires_grad: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 2, 8, generator=g)
    b = torch.randn(8, generator=g) if bias else None
    residual = torch.randn(5, 2, 8, generator=g).to(residual_dtype)
    if requires_grad:
        x.requires_grad_(True)
    return x, b, residual


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("residual_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("requires_grad", [True, False])
def test_residual_sum_is_megatrons_bias_dropout_add_at_dropout_0(
    training, bias, residual_dtype, requires_grad
):
    from megatron.core.fusions.fused_bias_dropout import _bias_dropout_add_func

    x, b, residual = _tensors(bias, residual_dtype, requires_grad)
    theirs = _bias_dropout_add_func((x.clone(), b), residual, 0.0, training)
    given = x.clone() if not requires_grad else x
    ours = _add_residual(training, given, b, residual)
    assert ours.dtype == theirs.dtype == x.dtype
    assert torch.equal(ours, theirs)
    # megatron sums in place where nothing needs a gradient outside training: so do we
    assert (ours is given) == (not training and not requires_grad)
    if requires_grad:
        ours.sum().backward()
        assert torch.equal(x.grad, torch.ones_like(x))


def test_calls_it_does_not_cover_go_to_megatrons_forward():
    seen = []

    def megatron_forward(self, *args, **kwargs):
        seen.append((args, sorted(kwargs)))
        return "megatron's"

    forward = _lean_forward(megatron_forward)
    assert forward.megatron_fn is megatron_forward
    x = torch.ones(3, 1, 4)
    layer = types.SimpleNamespace(_lean_forward=True)  # a layer it covers, by its flag
    calls = [
        ((x,), {}),  # positional
        ((), {"attention_mask": None}),  # no hidden states by name
        ((), {"hidden_states": x, "inference_context": object()}),
        ((), {"hidden_states": x, "context": x}),  # cross-attention
        ((), {"hidden_states": x, "inference_params": object()}),  # a keyword it does not take
        ((), {"hidden_states": x, "dynamic_inference_decode_only": False}),
    ]
    for args, kwargs in calls:
        assert forward(layer, *args, **kwargs) == "megatron's"
    assert len(seen) == len(calls)
    # a layer it does not cover (here: not megatron's TransformerLayer), decided once
    other = types.SimpleNamespace()
    assert forward(other, hidden_states=x) == "megatron's"
    assert other._lean_forward is False


def test_use_lean_layer_wraps_megatrons_forward_once():
    from megatron.core.transformer.transformer_layer import TransformerLayer

    assert use_lean_layer() is True and use_lean_layer() is True
    megatron_forward = TransformerLayer.forward.megatron_fn
    assert not hasattr(megatron_forward, "megatron_fn")
    assert megatron_forward.__qualname__ == "TransformerLayer.forward"
