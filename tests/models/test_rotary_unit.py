"""Unit tier: RoPE in three passes (`megatron_rl.models.rotary`) against megatron-core's own."""

import types

import pytest
import torch

from megatron_rl.models.rotary import (
    RotateHalf,
    apply_rope,
    apply_rope_packed,
    segment_positions,
    use_rotate_half_rope,
)
from tests.tolerances import BF16_MODEL, FP32_EXACT_ORDER, assert_close

S, B, GROUPS, HEADS, D = 12, 3, 2, 4, 16


def _device():
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _qkv(dtype=torch.float32, seed=0):
    """A fused QKV activation [s, b, groups, (heads/groups + 2) * d] and its query and key
    views split from it, strided as megatron's attention hands them to RoPE."""
    g = torch.Generator().manual_seed(seed)
    per = HEADS // GROUPS
    mixed = torch.randn(S, B, GROUPS, (per + 2) * D, generator=g).to(_device(), dtype)
    mixed.requires_grad_(True)
    q, k, _ = torch.split(mixed, [per * D, D, D], dim=3)
    return mixed, q.reshape(S, B, HEADS, D), k


def _freqs(d=D):
    """megatron's RotaryEmbedding layout: [s, 1, 1, d], the half's angles repeated."""
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = torch.outer(torch.arange(S, dtype=torch.float32), inv)
    return torch.cat([angles, angles], dim=-1)[:, None, None, :].to(_device())


def _megatron_rope(t, freqs, mscale=1.0):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    return _apply_rotary_pos_emb_bshd(t, freqs, mscale=mscale)


def _forward_backward(rope, dtype, mscale):
    mixed, q, k = _qkv(dtype)
    freqs = _freqs()
    out_q, out_k = rope(q, freqs, mscale), rope(k, freqs, mscale)
    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(o.shape, generator=g).to(o.device, o.dtype) for o in (out_q, out_k)]
    sum((o * w).sum() for o, w in zip((out_q, out_k), weights, strict=True)).backward()
    return out_q, out_k, mixed.grad


@pytest.mark.parametrize("mscale", [1.0, 0.7])
def test_equal_to_megatron_in_value_and_gradient(mscale):
    ours = _forward_backward(apply_rope, torch.float32, mscale)
    theirs = _forward_backward(_megatron_rope, torch.float32, mscale)
    for name, a, e in zip(("query", "key", "fused qkv gradient"), ours, theirs, strict=True):
        assert a.shape == e.shape and a.dtype == e.dtype
        assert_close(a.detach().cpu(), e.detach().cpu(), FP32_EXACT_ORDER, name)
    # the value slice of the fused tensor gets no gradient from RoPE
    assert torch.count_nonzero(ours[2][..., -D:]) == 0


def test_bf16_within_bf16_rounding_of_fp32():
    ours = _forward_backward(apply_rope, torch.bfloat16, 1.0)
    reference = _forward_backward(_megatron_rope, torch.float32, 1.0)
    for a, e in zip(ours, reference, strict=True):
        assert a.dtype == torch.bfloat16
        assert_close(a.detach().float().cpu(), e.detach().cpu(), BF16_MODEL)


def _no_context_parallelism():
    return types.SimpleNamespace(size=lambda: 1, rank=lambda: 0)


def test_packed_segments_restart_their_positions():
    bounds = torch.tensor([0, 3, 8, 10, 12], dtype=torch.int32, device=_device())
    assert segment_positions(bounds, 12).tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 0, 1]
    with pytest.raises(RuntimeError):
        segment_positions(bounds, 13)  # bounds that do not cover the tokens are refused


def test_packed_equal_to_megatron_in_value_and_gradient():
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd

    bounds = torch.tensor([0, 5, 7, S], dtype=torch.int32, device=_device())
    freqs = _freqs()[:5]  # megatron's: as many positions as the longest segment
    results = []
    for rope in (
        lambda t: apply_rope_packed(t, bounds, freqs, 0.7),
        lambda t: _apply_rotary_pos_emb_thd(
            t, bounds, freqs, mscale=0.7, cp_group=_no_context_parallelism()
        ),
    ):
        mixed, q, _ = _qkv()
        packed_q = q[:, 0]  # [T, heads, d]: one micro-batch's rows back to back
        out = rope(packed_q)
        (out * torch.arange(out.numel(), device=out.device).view_as(out).sin()).sum().backward()
        results.append((out.detach().cpu(), mixed.grad.cpu()))
    for a, e in zip(*results, strict=True):
        assert_close(a, e, FP32_EXACT_ORDER)


def test_the_rotation_is_a_rotation():
    """Each pair (x_i, x_{i+d/2}) turns by its angle: norms of the pairs are kept, and a
    position-0 token (angle 0) comes out unchanged."""
    _, q, _ = _qkv()
    out = apply_rope(q.detach(), _freqs())
    pairs = lambda x: x[..., : D // 2].square() + x[..., D // 2 :].square()  # noqa: E731
    assert_close(pairs(out).cpu(), pairs(q.detach()).cpu(), {"rtol": 1e-5, "atol": 1e-5})
    assert torch.equal(out[0], q.detach()[0])
    assert not torch.allclose(out[1:], q.detach()[1:])


def _config(**changes):
    fields = dict(apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=False)
    return types.SimpleNamespace(**{**fields, **changes})


def _rotated_here(out) -> bool:
    """Whether `RotateHalf` made `out` (or what a view of it was taken from)."""
    node = out.grad_fn
    while node is not None and not type(node).__name__.startswith(RotateHalf.__name__):
        view = type(node).__name__.startswith(("Squeeze", "Unsqueeze", "View"))
        node = node.next_functions[0][0] if view else None
    return node is not None


def test_megatron_attention_routes_the_covered_case_here_and_the_rest_to_megatron():
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import attention

    assert use_rotate_half_rope() is True
    assert use_rotate_half_rope() is True  # idempotent: wraps megatron's function once
    rope = attention.apply_rotary_pos_emb
    assert rope.megatron_fn is rope_utils.apply_rotary_pos_emb
    _, q, _ = _qkv()
    freqs = _freqs()
    cp = _no_context_parallelism()
    packed = torch.tensor([0, 5, S], dtype=torch.int32, device=q.device)
    assert _rotated_here(rope(q, freqs, config=_config(), cp_group=cp))
    assert _rotated_here(rope(q[:, 0], freqs, config=_config(), cu_seqlens=packed, cp_group=cp))
    for config, t, f, cu_seqlens in [
        (_config(rotary_interleaved=True), q, freqs, None),
        (_config(multi_latent_attention=True), q, freqs, None),
        (_config(), q, _freqs(D // 2), None),  # partial rotary: part of the head left as it is
        (_config(rotary_interleaved=True), q[:, 0], freqs, packed),
    ]:
        kwargs = dict(config=config, cu_seqlens=cu_seqlens, cp_group=cp)
        out = rope(t, f, **kwargs)
        assert not _rotated_here(out)
        expected = rope_utils.apply_rotary_pos_emb(t, f, **kwargs)
        assert_close(out.detach().cpu(), expected.detach().cpu(), FP32_EXACT_ORDER)


def test_cos_and_sin_are_made_once_per_angles_tensor():
    """Every layer rotates by the same angles tensor: its cos and sin are made once, and made
    again for another tensor (even of equal values), after an in-place change, for another
    dtype or scale, and for packed rows with other bounds."""
    from megatron_rl.models.rotary import _TABLES

    freqs = _freqs()
    first = _TABLES.get(freqs, 1.0, torch.float32)
    assert all(a is b for a, b in zip(_TABLES.get(freqs, 1.0, torch.float32), first, strict=True))
    assert_close(first[0], torch.cos(freqs), FP32_EXACT_ORDER)
    assert _TABLES.get(freqs.clone(), 1.0, torch.float32)[0] is not first[0]
    assert _TABLES.get(freqs, 0.5, torch.float32)[1] is not first[1]
    assert _TABLES.get(freqs, 1.0, torch.bfloat16)[0].dtype == torch.bfloat16
    _TABLES.get(freqs, 1.0, torch.float32)
    freqs.mul_(2)  # the version counter moves: the tables follow the new values
    assert_close(_TABLES.get(freqs, 1.0, torch.float32)[1], torch.sin(freqs), FP32_EXACT_ORDER)
    bounds = torch.tensor([0, 5, S], device=freqs.device)
    packed = _TABLES.get(freqs, 1.0, torch.float32, bounds, S)
    assert packed[0].shape == (S, 1, 1, D)
    assert _TABLES.get(freqs, 1.0, torch.float32, bounds, S)[0] is packed[0]
    other = _TABLES.get(freqs, 1.0, torch.float32, torch.tensor([0, 7, S], device=freqs.device), S)
    assert not torch.equal(other[0], packed[0])
    assert_close(other[0][7], torch.cos(freqs[0]), FP32_EXACT_ORDER)  # the second row's start
