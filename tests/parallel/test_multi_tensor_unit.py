"""Unit tier: megatron-core's multi-tensor fallbacks on torch's foreach kernels
(`megatron_rl.parallel.multi_tensor`): the gradient norm kept on the device, the scale."""

import pytest
import torch

from megatron_rl.parallel import cpu_compat
from megatron_rl.parallel.multi_tensor import device_l2_norm, foreach_scale, use_foreach_kernels
from tests.tolerances import FP32_MODEL, assert_close


def _grads(device, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    shapes = [(128, 64), (64,), (1,), (500, 128), (3, 7, 5)]
    # magnitudes far apart, as an embedding's and a norm's gradients are
    return [
        (torch.randn(s, generator=g) * 10.0**k).to(device=device, dtype=dtype)
        for k, s in zip((-3, 0, 2, -1, 1), shapes, strict=True)
    ]


def _reference(tensors):
    return torch.linalg.vector_norm(torch.cat([t.double().flatten() for t in tensors]))


def _device():
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def test_the_norm_of_every_tensor_together_on_their_device():
    grads = _grads(_device())
    norm, per_tensor = device_l2_norm(2048 * 32, None, [grads[:2], grads[2:]], False)
    assert per_tensor is None
    assert norm.shape == (1,) and norm.dtype == torch.float32 and norm.device == grads[0].device
    assert_close(norm.cpu(), _reference(grads).reshape(1), FP32_MODEL)


def test_bf16_gradients_are_summed_in_float32():
    grads = _grads(_device(), torch.bfloat16)
    norm, _ = device_l2_norm(2048 * 32, None, [grads], False)
    assert norm.dtype == torch.float32
    # the bf16 values exactly, their squares added in float32 (not rounded to bf16's 8 bits)
    assert_close(norm.cpu(), _reference(grads).reshape(1), FP32_MODEL)


def test_per_tensor_norms_and_an_empty_list_are_refused():
    with pytest.raises(NotImplementedError, match="per_tensor"):
        device_l2_norm(2048 * 32, None, [_grads("cpu")], True)
    with pytest.raises(ValueError, match="no tensors"):
        device_l2_norm(2048 * 32, None, [[]], False)


def test_megatrons_gradient_clip_uses_it_and_gives_the_same_norm(world_of_one):
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as optimizer_mod

    cpu_compat.apply()
    assert use_foreach_kernels()  # this environment has neither apex nor Transformer Engine
    assert clip_grads.l2_norm_impl is device_l2_norm
    assert clip_grads.multi_tensor_scale_impl is foreach_scale
    assert optimizer_mod.multi_tensor_scale_impl is foreach_scale
    assert use_foreach_kernels()  # idempotent
    grads = _grads("cpu")
    total = clip_grads.get_grad_norm_fp32(grads)  # megatron's own, reduced over the world
    assert_close(total, _reference(grads), FP32_MODEL)


@pytest.mark.gpu
def test_no_host_synchronisation_on_cuda():
    grads = _grads("cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call raises
    try:
        norm, _ = device_l2_norm(2048 * 32, None, [grads], False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_close(norm.cpu(), _reference(grads).reshape(1), FP32_MODEL)


def _megatron_scale(srcs, dsts, scale):
    """megatron-core's own fallback (`local_multi_tensor_scale`), on copies."""
    from megatron.core.utils import local_multi_tensor_scale

    dsts = [d.clone() for d in dsts]
    local_multi_tensor_scale(2048 * 32, None, [srcs, dsts], scale)
    return dsts


@pytest.mark.parametrize("scale", [1.0, 0.37])
@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.bfloat16])
def test_the_scale_is_megatrons_to_the_bit_into_another_tensor(scale, dst_dtype):
    """As bf16 training copies its fp32 master weights into the model's (scale 1) and a clip
    scales: the product in the source's dtype, rounded once into the destination's."""
    srcs = _grads(_device())
    dsts = [torch.zeros_like(s, dtype=dst_dtype) for s in srcs]
    expected = _megatron_scale(srcs, dsts, scale)
    before = [s.clone() for s in srcs]
    foreach_scale(2048 * 32, None, [srcs, dsts], scale)
    for d, e in zip(dsts, expected, strict=True):
        assert d.dtype == dst_dtype and torch.equal(d, e)
    assert all(torch.equal(s, b) for s, b in zip(srcs, before, strict=True))  # sources kept


def test_the_scale_in_place_is_megatrons_to_the_bit():
    """The clip's form: sources and destinations the same tensors."""
    grads = _grads(_device())
    expected = _megatron_scale(grads, grads, 0.125 / 3)
    foreach_scale(2048 * 32, None, [grads, grads], 0.125 / 3)
    assert all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True))


def test_lists_of_different_lengths_are_refused():
    grads = _grads("cpu")
    with pytest.raises(ValueError, match="5 sources for 4 destinations"):
        foreach_scale(2048 * 32, None, [grads, grads[:4]], 1.0)
    foreach_scale(2048 * 32, None, [[], []], 0.5)  # nothing to do


@pytest.mark.gpu
def test_the_scale_makes_no_host_synchronisation_on_cuda():
    srcs = _grads("cuda")
    dsts = [torch.empty_like(s, dtype=torch.bfloat16) for s in srcs]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call raises
    try:
        foreach_scale(2048 * 32, None, [srcs, dsts], 1.0)
        foreach_scale(2048 * 32, None, [srcs, srcs], 0.5)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.equal(d, s.to(torch.bfloat16)) for d, s in zip(dsts, srcs, strict=True))
