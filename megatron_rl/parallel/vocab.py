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
    if masked.data_ptr() == logits.data_ptr():
        # megatron's cross-entropy subtracts the max and exponentiates in place: on a copy,
        # never on the caller's logits (which an entropy may read next)
        masked = masked.clone()
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


# Elements of one [tokens, V/tp] fp32 chunk of logits (256 MiB; backward holds about four such
# tensors at once): a 152k vocabulary at TP1 is 441 tokens a chunk, a GEMM still large enough
# to run at full speed; a small vocabulary takes a whole micro-batch in one chunk.
CHUNK_ELEMENTS = 2**26


def chunk_tokens(local_vocab: int, chunk_elements: int = CHUNK_ELEMENTS) -> int:
    """Tokens per chunk so that one chunk's fp32 logits hold `chunk_elements` elements."""
    return max(1, chunk_elements // local_vocab)


class _ChunkedLogProbsEntropy(torch.autograd.Function):
    """Log-probs of labels and entropy of softmax(hidden @ W^T / T), chunk by chunk over
    tokens, never holding more than one chunk's [C, V/tp] logits: forward keeps only the
    per-token log-sum-exp and entropy, backward recomputes each chunk's logits (Liger's fused
    linear cross-entropy, Hsu et al. 2024, extended to entropy and vocabulary parallelism).

    With l the tempered logits, p = softmax(l), lse = log sum exp l:
      d log p(y) / d l = onehot(y) - p;   d H / d l = -p * (log p + H).
    Both are local to this rank's vocabulary slice once lse is the global one, so backward
    needs no collective: the hidden states' gradient is this slice's partial sum, reduced
    over TP by whatever made `hidden` (`models/lm_head.py`), as megatron's output layer does.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, vocab_size, temperature, chunk):
        rank, tp_size, group = _tp()
        local = weight.shape[0]
        first = rank * local
        n = hidden.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(lse)
        target = torch.empty_like(lse)
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            logits = _chunk_logits(hidden[start:end], weight, vocab_size, temperature, first)
            m = logits.amax(dim=-1)
            if tp_size > 1:
                torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=group)
            e = torch.exp(logits - m[:, None])
            local_label = labels[start:end] - first
            here = (local_label >= 0) & (local_label < local)
            picked = logits.gather(1, local_label.clamp(0, local - 1)[:, None]).squeeze(1)
            sums = torch.stack([e.sum(-1), (e * logits).sum(-1), torch.where(here, picked, 0.0)])
            if tp_size > 1:
                torch.distributed.all_reduce(sums, group=group)
            s, t = sums[0], sums[1]
            target[start:end] = sums[2]
            lse[start:end] = m + torch.log(s)
            entropy[start:end] = lse[start:end] - t / s
        ctx.save_for_backward(hidden, weight, labels, lse, entropy)
        ctx.set_materialize_grads(False)  # an output no loss reads gets None, not zeros
        ctx.vocab_size, ctx.temperature, ctx.chunk, ctx.first = (
            vocab_size,
            temperature,
            chunk,
            first,
        )
        return target - lse, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, labels, lse, entropy = ctx.saved_tensors
        local, first = weight.shape[0], ctx.first
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            if ctx.needs_input_grad[1]
            else None
        )
        for start in range(0, hidden.shape[0], ctx.chunk):
            end = min(start + ctx.chunk, hidden.shape[0])
            h = hidden[start:end]
            logits = _chunk_logits(h, weight, ctx.vocab_size, ctx.temperature, first)
            log_p = logits - lse[start:end, None]
            p = torch.exp(log_p)
            grad = torch.zeros_like(p)
            if grad_logprobs is not None:
                g = grad_logprobs[start:end]
                grad -= p * g[:, None]
                # the label's own column gets + g, on the rank whose slice holds it
                local_label = labels[start:end] - first
                rows = torch.nonzero((local_label >= 0) & (local_label < local)).squeeze(1)
                grad[rows, local_label[rows]] += g[rows]
            if grad_entropy is not None:
                g = grad_entropy[start:end, None]
                grad -= g * p * (log_p + entropy[start:end, None])
            if ctx.temperature != 1.0:
                grad /= ctx.temperature
            # the logits were made in the weight's dtype: their gradient is cast back to it
            grad = grad.to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[start:end] = grad @ weight
            if grad_weight is not None:
                grad_weight += (grad.t() @ h).float()
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def _chunk_logits(hidden, weight, vocab_size: int, temperature: float, first: int):
    """fp32 tempered logits [C, V/tp] of one chunk, vocabulary padding masked (see module)."""
    logits = _scaled(hidden @ weight.t(), temperature)
    if first + weight.shape[0] > vocab_size:
        ids = torch.arange(weight.shape[0], device=logits.device) + first
        logits = logits.masked_fill(ids >= vocab_size, torch.finfo(logits.dtype).min)
    return logits


def chunked_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    temperature: float = 1.0,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(labels), entropy) under softmax(hidden @ weight^T / temperature), without ever
    materialising the [tokens, V/tp] logits: `chunk` tokens at a time (default: one chunk's
    fp32 logits are `CHUNK_ELEMENTS`), recomputed in backward.

    hidden: [..., h] (the output layer's input, whole sequence, in the weight's dtype);
    weight: [V/tp, h] this TP rank's vocabulary slice; labels: [...] ids < vocab_size.
    Returns two fp32 tensors shaped like `labels`, equal to `vocab_parallel_logprobs` and
    `vocab_parallel_entropy` of the full logits, gradients included.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    shape = labels.shape
    chunk = chunk or chunk_tokens(weight.shape[0])
    logprobs, entropy = _ChunkedLogProbsEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]).to(weight.dtype),
        weight,
        labels.reshape(-1),
        vocab_size,
        temperature,
        chunk,
    )
    return logprobs.view(shape), entropy.view(shape)
