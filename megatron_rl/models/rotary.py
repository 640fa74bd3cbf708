"""Rotary position embedding (Su et al. 2021, "RoFormer", arXiv:2104.09864) applied in a few
passes, for megatron-core's unfused path.

Without Transformer Engine's fused kernel, megatron-core applies RoPE to the queries and keys
of every layer with `rope_utils._apply_rotary_pos_emb_bshd`: a chunk, a negation and a
concatenation to rotate the halves, two products and a sum, and one more concatenation with
the (empty) part left unrotated, each a pass over the tensor, and each undone in backward.
On the 2-core CPU the two concatenations of strided [s, b, n, d] views were the costliest of
them (profiled: 79 `cat` calls per update against the plain PyTorch step's 34, 4x their
time). `RotateHalf` computes the same

    out = t * cos + rotate_half(t) * sin,   rotate_half([t1, t2]) = [-t2, t1]

as one product and a multiply-add into each half of the result, and its backward as the
transposed rotation, g * cos + [g2 * sin2, -g1 * sin1]: three passes each way, saving cos and
sin ([s, 1, 1, d]) as megatron's products do. Packed segments (megatron's `thd` layout) take
each token's angle at its position within its segment, found on the device, where megatron
copies the bounds to the host and splits the tensor segment by segment at every layer.
`use_rotate_half_rope()` puts these where megatron's attention calls `apply_rotary_pos_emb`,
for the cases they cover (non-interleaved RoPE over the whole head; `bshd`, or `thd` without
context parallelism); every other case (interleaved, partial rotary, multi-latent attention,
context-parallel packing, a fused kernel asked for) goes to megatron-core's own function
unchanged.
"""

from __future__ import annotations

import weakref

import torch


class RotateHalf(torch.autograd.Function):
    """t * cos + rotate_half(t) * sin for t [..., d] and cos, sin broadcastable to it (d even,
    the halves' frequencies in the order megatron and Hugging Face lay them out)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = t.shape[-1] // 2
        out = t * cos
        out[..., :half].addcmul_(t[..., half:], sin[..., :half], value=-1)
        out[..., half:].addcmul_(t[..., :half], sin[..., half:])
        ctx.save_for_backward(cos, sin)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        half = grad.shape[-1] // 2
        # out1 = t1 c1 - t2 s1, out2 = t2 c2 + t1 s2: dt1 = g1 c1 + g2 s2, dt2 = g2 c2 - g1 s1
        grad_t = grad * cos
        grad_t[..., :half].addcmul_(grad[..., half:], sin[..., half:])
        grad_t[..., half:].addcmul_(grad[..., :half], sin[..., :half], value=-1)
        return grad_t, None, None


class _Tables:
    """cos and sin of the last angles asked for. Every layer of a forward rotates its queries
    and keys by the same tensor of angles (megatron's rotary embedding makes it once and
    caches it across forwards), so they are made once, not twice a layer. Matched by the
    angles tensor itself (a weak reference: a tensor made later at a freed one's address
    never matches), its version counter (an in-place change never matches), the scale and
    dtype, and for packed rows the segments' bounds likewise."""

    def __init__(self):
        self.refs, self.key, self.tables = (), None, None

    def get(self, freqs, mscale: float, dtype, cu_seqlens=None, total: int = 0):
        tensors = (freqs,) if cu_seqlens is None else (freqs, cu_seqlens)
        key = (*(x._version for x in tensors), mscale, dtype, total)
        key += (torch.is_inference_mode_enabled(),)
        held = tuple(ref() for ref in self.refs)
        if (
            key != self.key
            or len(held) != len(tensors)
            or any(h is not x for h, x in zip(held, tensors, strict=False))
        ):
            angles = freqs
            if cu_seqlens is not None:  # each packed token's angle at its place in its row
                angles = freqs[segment_positions(cu_seqlens, total)]
            self.tables = (
                (torch.cos(angles) * mscale).to(dtype),
                (torch.sin(angles) * mscale).to(dtype),
            )
            self.refs, self.key = tuple(weakref.ref(x) for x in tensors), key
        return self.tables


_TABLES = _Tables()


def apply_rope(t: torch.Tensor, freqs: torch.Tensor, mscale: float = 1.0) -> torch.Tensor:
    """RoPE of t [s, b, n, d] at angles freqs [s, 1, 1, d] (fp32), cos and sin scaled by
    `mscale` and cast to t's dtype first, as megatron-core does."""
    return RotateHalf.apply(t, *_TABLES.get(freqs, mscale, t.dtype))


def segment_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[total] the position of each packed token within its segment, from the segments'
    bounds [n + 1] (which must end at `total`: checked on the device, no host
    synchronisation)."""
    torch._assert_async(cu_seqlens[-1] == total, "cu_seqlens must end at the packed length")
    starts = cu_seqlens[:-1].long()
    lengths = cu_seqlens[1:].long() - starts
    first = torch.repeat_interleave(starts, lengths, output_size=total)
    return torch.arange(total, device=cu_seqlens.device) - first


def apply_rope_packed(
    t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, mscale: float = 1.0
) -> torch.Tensor:
    """RoPE of packed segments, megatron's `thd` layout: t [T, n, d], each segment of
    `cu_seqlens` at positions 0, 1, ... (what megatron-core's `_apply_rotary_pos_emb_thd`
    computes without context parallelism, without its per-segment split and host copy of the
    bounds); freqs [max segment length, 1, 1, d]."""
    cos, sin = _TABLES.get(freqs, mscale, t.dtype, cu_seqlens, t.shape[0])  # [T, 1, 1, d]
    return RotateHalf.apply(t.unsqueeze(1), cos, sin).squeeze(1)


def _rotary_pos_emb(megatron_fn):
    """megatron's `apply_rotary_pos_emb` signature, taking the covered cases itself."""

    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None):
        covered = (
            not config.apply_rope_fusion
            and not config.rotary_interleaved
            and not config.multi_latent_attention
            and freqs.shape[-1] == t.shape[-1]
            and t.shape[-1] % 2 == 0
        )
        if covered and cu_seqlens is None and t.dim() == 4:
            return apply_rope(t, freqs, mscale)
        packed = cu_seqlens is not None and t.dim() == 3
        if covered and packed and cp_group is not None and cp_group.size() == 1:
            return apply_rope_packed(t, cu_seqlens, freqs, mscale)
        return megatron_fn(
            t, freqs, config=config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group
        )

    apply_rotary_pos_emb.megatron_fn = megatron_fn
    return apply_rotary_pos_emb


def use_rotate_half_rope() -> bool:
    """Route megatron-core's attention's RoPE through `apply_rope` (or `apply_rope_packed`)
    where it covers the case (above). Returns whether it is in place; idempotent."""
    # why: megatron-core takes seconds to import: loaded on first use
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import attention

    if attention.apply_rotary_pos_emb is rope_utils.apply_rotary_pos_emb:
        attention.apply_rotary_pos_emb = _rotary_pos_emb(rope_utils.apply_rotary_pos_emb)
    return getattr(attention.apply_rotary_pos_emb, "megatron_fn", None) is not None
