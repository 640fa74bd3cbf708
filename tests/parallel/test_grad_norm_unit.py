"""Unit tier: the gradient norm kept on the device (`megatron_rl.parallel.grad_norm`)."""

import pytest
import torch

from megatron_rl.parallel import cpu_compat
from megatron_rl.parallel.grad_norm import device_l2_norm, use_device_l2_norm
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

    cpu_compat.apply()
    assert use_device_l2_norm()  # this environment has neither apex nor Transformer Engine
    assert clip_grads.l2_norm_impl is device_l2_norm
    assert use_device_l2_norm()  # idempotent
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
