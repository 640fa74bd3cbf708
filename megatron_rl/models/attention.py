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
`core_attn` checkpoints this module) work as with the unfused module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class SDPAttention(torch.nn.Module):
    """Causal self-attention over a whole micro-batch with fused kernels.

    Takes what megatron-core's `DotProductAttention` takes and returns what it returns:
    query [sq, b, np, hn], key and value [sk, b, ng, hn] (np query heads and ng key/value
    groups on this tensor-parallel rank) -> context [sq, b, np * hn]. Anything that module
    would do and this one does not (an explicit attention mask, attention bias, packed
    sequences, sliding windows, query-key layer scaling, a softmax offset, context
    parallelism) is refused by name.
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
                ("packed_seq_params", packed_seq_params),
            )
            if arg is not None
        ]
        if given:
            raise ValueError(f"SDPAttention is causal over whole rows; refused: {', '.join(given)}")
        sq, b, heads, head_dim = query.shape
        # [s, b, n, d] -> [b, n, s, d], the layout the kernels take (strided views: the
        # kernels copy what they need, no extra [s, s] anything)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        context = F.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            dropout_p=self.dropout if self.training else 0.0,
            scale=self.softmax_scale,
            enable_gqa=k.shape[1] != heads,
        )
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return context.permute(2, 0, 1, 3).reshape(sq, b, heads * head_dim)
