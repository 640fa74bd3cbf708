"""Core attention from PyTorch's fused kernels, for megatron-core's local layer spec.

Without Transformer Engine, megatron-core's local spec computes attention unfused
(`DotProductAttention`): it repeats K and V to every query head, materialises the
[b * heads, s, s] scores and keeps the softmax for backward. That is O(s^2) memory per
layer, and what made one 8k-token sequence of a 0.5B model run out of a 139 GiB GPU.

`SDPAttention` is a drop-in `core_attention` for the same spec that calls
`torch.nn.functional.scaled_dot_product_attention` with `is_causal=True`: flash attention
(Dao 2022) or the memory-efficient kernel on CUDA, the flash kernel on CPU. No s x s tensor is
ever made, forward or backward; grouped-query attention is passed to the kernel as it is
(`enable_gqa`), without repeating K and V. It sits below the QKV projection, so tensor
parallelism (heads split over ranks), sequence parallelism (the projection gathers the
sequence before it), pipeline parallelism and activation recompute (megatron's selective
`core_attn` checkpoints this module) work as with the unfused module. Packed micro-batches
(megatron's `thd` layout) attend within each of their segments: in one call of flash
attention's variable-length kernel on CUDA in half precision, one call a segment elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class SDPAttention(torch.nn.Module):
    """Causal self-attention over a whole micro-batch with fused kernels.

    Takes what megatron-core's `DotProductAttention` takes and returns what it returns:
    query [sq, b, np, hn], key and value [sk, b, ng, hn] (np query heads and ng key/value
    groups on this tensor-parallel rank) -> context [sq, b, np * hn]; packed sequences in
    megatron's `thd` layout too (`_packed`), which that module cannot run. Anything else it
    would do and this one does not (an explicit attention mask, attention bias, sliding
    windows, query-key layer scaling, a softmax offset, context parallelism) is refused by
    name.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__()
        # why: megatron-core takes seconds to import: loaded on first use
        from megatron.core.transformer.enums import AttnMaskType

        refused = {
            "context_parallel_size": config.context_parallel_size != 1,
            "apply_query_key_layer_scaling": config.apply_query_key_layer_scaling,
            "window_size": config.window_size is not None,
            "softmax_type": config.softmax_type != "vanilla",
            "attn_mask_type": attn_mask_type != AttnMaskType.causal,
        }
        if any(refused.values()):
            names = ", ".join(name for name, bad in refused.items() if bad)
            raise ValueError(f"SDPAttention supports causal self-attention only; refused: {names}")
        self.config = config
        self.softmax_scale = softmax_scale
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        given = [
            name
            for name, arg in (
                ("attention_mask", attention_mask),
                ("attention_bias", attention_bias),
            )
            if arg is not None
        ]
        if given:
            raise ValueError(f"SDPAttention is causal within each sequence; refused: {given}")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        sq, b, heads, head_dim = query.shape
        # [s, b, n, d] -> [b, n, s, d], the layout the kernels take (strided views: the
        # kernels copy what they need, no extra [s, s] anything)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return self._attend(q, k, v).permute(2, 0, 1, 3).reshape(sq, b, heads * head_dim)

    def _attend(self, q, k, v) -> torch.Tensor:
        """[b, n, s, d] queries, [b, g, s, d] keys and values -> [b, n, s, d]."""
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            dropout_p=self.dropout if self.training else 0.0,
            scale=self.softmax_scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )

    def _packed(self, query, key, value, params) -> torch.Tensor:
        """megatron's `thd` layout (packed sequences, `data/packing.py`): query [t, np, hn],
        key and value [t, ng, hn], segments at `cu_seqlens` -> [t, np * hn], each segment
        attending causally within itself only: the cost is that of the segments,
        sum(l_i^2), never t^2. Where flash attention's variable-length kernel runs
        (`flash_varlen_runs`: CUDA, half precision) all segments go to it in one call, grouped
        query attention included; elsewhere (PyTorch's CPU build has no such kernel) one
        call a segment. The segments' bounds come from `params.host_bounds` where set, else
        from the device."""
        if params.qkv_format != "thd":
            raise ValueError(f"packed_seq_params.qkv_format={params.qkv_format!r}: expected thd")
        extra = [
            name
            for name in ("cu_seqlens_q_padded", "cu_seqlens_kv_padded")
            if getattr(params, name) is not None
        ]
        same = params.cu_seqlens_q is params.cu_seqlens_kv
        if extra or not (same or torch.equal(params.cu_seqlens_q, params.cu_seqlens_kv)):
            raise ValueError(
                "SDPAttention packs self-attention with one set of segments: cu_seqlens_q == "
                f"cu_seqlens_kv and no padded ones (got {extra or 'different q/kv segments'})"
            )
        # the bounds on the host where packing made them (`data/packing.py`); reading them
        # from the device would make the host wait for it at every layer
        bounds = getattr(params, "host_bounds", None)
        if bounds is None:
            bounds = params.cu_seqlens_q.tolist()
        if bounds[0] != 0 or bounds[-1] != query.shape[0]:
            raise ValueError(f"cu_seqlens {bounds} do not cover the {query.shape[0]} tokens")
        t, heads, head_dim = query.shape
        if flash_varlen_runs(query):
            longest = max(end - start for start, end in zip(bounds, bounds[1:], strict=False))
            # the aten op that torch's own `varlen_attn` and jagged tensors call; its
            # positional signature has held since torch 2.2, the public wrapper's has not
            out = torch.ops.aten._flash_attention_forward(
                query,
                key,
                value,
                params.cu_seqlens_q,
                params.cu_seqlens_kv,
                longest,
                longest,
                self.dropout if self.training else 0.0,
                True,  # causal
                False,  # no debug mask
                scale=self.softmax_scale,
            )[0]
            return out.reshape(t, heads * head_dim)
        pieces = []
        for start, end in zip(bounds, bounds[1:], strict=False):
            # [l, n, d] -> [1, n, l, d]
            q, k, v = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
            pieces.append(self._attend(q, k, v)[0].transpose(0, 1))
        return torch.cat(pieces).reshape(t, heads * head_dim)


def flash_varlen_runs(query: torch.Tensor) -> bool:
    """Whether flash attention's variable-length kernel takes these queries [t, n, d]: on
    CUDA from Ampere on (torch builds its flash kernels for sm80+), in a torch built with
    them and with flash SDPA left enabled (`torch.backends.cuda.enable_flash_sdp(False)`
    turns this off too), in fp16 or bf16, with a head size it has kernels for (a multiple
    of 8, at most 256)."""
    return (
        query.is_cuda
        and query.dtype in (torch.float16, torch.bfloat16)
        and query.shape[-1] % 8 == 0
        and query.shape[-1] <= 256
        and torch.backends.cuda.is_flash_attention_available()
        and torch.backends.cuda.flash_sdp_enabled()
        and torch.cuda.get_device_capability(query.device) >= (8, 0)
    )
