"""Shared pieces of the torchrun worker scripts (fixed inputs, logit gathering, output)."""

from __future__ import annotations

import torch


def fixed_tokens(vocab_size: int, batch: int = 2, seq: int = 16, seed: int = 7) -> torch.Tensor:
    """[batch, seq] token ids, identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq), generator=g)


def position_ids(tokens: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)


def gather_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """TP-sharded logits [b, s, v/tp] -> full [b, s, vocab_size] (padding rows dropped)."""
    from megatron.core import tensor_parallel

    full = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
    return full[..., :vocab_size]
