"""Per-token log-probs and entropy from tensor-parallel (vocab-sharded) logits.

Each TP rank holds logits [..., V/tp] for its slice of the (padded) vocabulary; the full
[..., V] tensor is never gathered. Log-probs use megatron's vocab-parallel cross-entropy;
entropy is reduced with three small all-reduces (max, sum exp, sum p*logit) that are
autograd-aware, so an entropy bonus trains correctly.

Megatron pads the vocabulary to a multiple of 128 * tp; the padding columns are masked to
the lowest finite value here, so they take no probability mass (their logits are 0, not
-inf, in the model: without this a log-prob is off by about log(padded / real)).

`temperature`: the distribution the rollout engine sampled from is softmax(logits / T), so
log-probs and entropy are of that distribution (T divides before the padding is masked:
the lowest finite value divided by T < 1 would overflow to -inf, and 0 * -inf is NaN).
"""

from __future__ import annotations

import torch


def _tp():
    # why: megatron-core takes seconds to import: loaded on first use
    from megatron.core import parallel_state

    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_group(),
    )


def mask_vocab_padding(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Out-of-place: padding columns (global id >= vocab_size) set to the lowest finite value."""
    rank, _, _ = _tp()
    local = logits.shape[-1]
    global_ids = torch.arange(local, device=logits.device) + rank * local
    if global_ids[-1] < vocab_size:
        return logits
    return logits.masked_fill(global_ids >= vocab_size, torch.finfo(logits.dtype).min)


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 logits / T, out of place (`.float()` of fp32 logits is the tensor itself)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    logits = logits.float()
    return logits if temperature == 1.0 else logits / temperature


def vocab_parallel_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, temperature: float = 1.0
) -> torch.Tensor:
    """log p(labels) under softmax(logits / temperature), from vocab-sharded logits.

    logits: [..., V/tp] (any leading dims, e.g. [B, S]); labels: [...] token ids < vocab_size.
    Returns [...] in fp32 (computed in fp32 whatever the logits' dtype).
    """
    # why: megatron-core takes seconds to import: loaded on first use
    from megatron.core import tensor_parallel

    masked = mask_vocab_padding(_scaled(logits, temperature), vocab_size).contiguous()
    return -tensor_parallel.vocab_parallel_cross_entropy(masked, labels)


def vocab_parallel_entropy(
    logits: torch.Tensor, vocab_size: int, temperature: float = 1.0
) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) over the full vocabulary from vocab-sharded
    logits: [..., V/tp] -> [...].

    H = log S + m - T / S, with m the global max (a constant shift), S = sum exp(l - m) and
    T = sum exp(l - m) * l over all ranks.
    """
    # why: megatron-core takes seconds to import: loaded on first use
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    _, tp_size, group = _tp()
    logits = mask_vocab_padding(_scaled(logits, temperature), vocab_size)
    m = logits.detach().amax(dim=-1, keepdim=True)
    if tp_size > 1:
        torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=group)
    e = torch.exp(logits - m)
    # Sum over ranks in forward, identity in backward: each rank's partial sum is a term.
    s = reduce_from_tensor_model_parallel_region(e.sum(dim=-1))
    t = reduce_from_tensor_model_parallel_region((e * logits).sum(dim=-1))
    return torch.log(s) + m.squeeze(-1) - t / s
