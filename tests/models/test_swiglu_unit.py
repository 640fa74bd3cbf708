"""Unit tier: SwiGLU saving its input alone (`megatron_rl.models.swiglu`) against megatron-core's
unfused MLP activation."""

import pytest
import torch
import torch.nn.functional as F

from megatron_rl.models.swiglu import _bias_swiglu, swiglu, use_fused_swiglu
from tests.tolerances import FP32_EXACT_ORDER, assert_close

S, B, F_ = 5, 3, 12


def _device():
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _fc1_output(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(S, B, 2 * F_, generator=g).to(_device(), dtype).requires_grad_(True)


def _megatron_unfused(x):
    """megatron-core's MLP without activation fusion (`glu`, glu_linear_offset 0)."""
    x_glu, x_linear = torch.chunk(x, 2, dim=-1)
    return F.silu(x_glu) * (x_linear + 0.0)


def _saved_elements(fn, x) -> int:
    """Elements of the storages autograd keeps for backward (a view keeps its whole base)."""
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes() // t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)
    return sum(saved.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_equals_megatrons_unfused_activation_in_value_and_gradient(dtype):
    outs, grads = [], []
    for fn in (swiglu, _megatron_unfused):
        x = _fc1_output(dtype)
        y = fn(x)
        y.backward(torch.linspace(-2, 2, y.numel(), device=y.device).view_as(y).to(dtype))
        outs.append(y.detach().float().cpu())
        grads.append(x.grad.float().cpu())
    assert outs[0].shape == (S, B, F_)
    # the same ops in the same order, each rounded once to the dtype: equal, bf16 included
    assert_close(outs[0], outs[1], FP32_EXACT_ORDER)
    assert_close(grads[0], grads[1], FP32_EXACT_ORDER)


def test_swiglu_saves_fc1s_output_alone():
    x = _fc1_output()
    assert _saved_elements(swiglu, x) == x.numel()
    assert _saved_elements(_megatron_unfused, x) == 2 * x.numel()  # + silu(x1), x2 + 0


def test_megatrons_fused_call_takes_a_bias_and_leaves_fp8_and_offload_to_megatron():
    calls = []

    def megatron_fn(input, bias, fp8_input_store, cpu_offload_input):  # noqa: A002
        calls.append((fp8_input_store, cpu_offload_input))
        return "megatron's"

    route = _bias_swiglu(megatron_fn)
    x = _fc1_output()
    bias = torch.randn(2 * F_, device=x.device, requires_grad=True)
    route(x, bias).sum().backward()
    expected = _megatron_unfused(x.detach() + bias.detach())
    assert_close(route(x, bias).detach().cpu(), expected.cpu(), FP32_EXACT_ORDER)
    assert bias.grad is not None and x.grad is not None
    assert route(x, None, True, False) == route(x, None, False, True) == "megatron's"
    assert calls == [(True, False), (False, True)]


def test_dense_models_ask_megatron_for_the_fused_activation_and_get_ours():
    from megatron.core.fusions import fused_bias_swiglu
    from megatron.core.transformer import mlp

    from megatron_rl.models.gpt import transformer_config
    from megatron_rl.models.presets import preset_arch
    from megatron_rl.parallel.distributed import ParallelLayout

    assert transformer_config(preset_arch("tiny"), ParallelLayout()).bias_activation_fusion
    # a MoE's experts would take megatron's compiled weighted kernel: no fusion asked there
    moe = transformer_config(preset_arch("qwen3-30b-a3b"), ParallelLayout())
    assert not moe.bias_activation_fusion
    assert use_fused_swiglu() is True and use_fused_swiglu() is True  # wraps once
    assert mlp.bias_swiglu_impl.megatron_fn is fused_bias_swiglu.bias_swiglu_impl
    x = _fc1_output()
    assert_close(
        mlp.bias_swiglu_impl(x, None).detach().cpu(),
        _megatron_unfused(x).detach().cpu(),
        FP32_EXACT_ORDER,
    )
