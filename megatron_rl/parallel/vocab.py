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
    Vocabulary padding (megatron pads to a multiple of 128 x TP) is left out of the product,
    so it takes no probability mass and gets no gradient. Each chunk is a few fused passes
    over its logits (log-sum-exp, then log p and p in place and a row dot for -sum p log p;
    in backward the same two and one multiply-add and one multiply, in place): elementwise
    passes, not the GEMMs, are what such a head costs.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, vocab_size, temperature, chunk):
        rank, tp_size, group = _tp()
        ctx.full_rows = weight.shape[0]
        first = rank * weight.shape[0]
        weight = weight[: max(0, min(weight.shape[0], vocab_size - first))]  # real rows only
        n = hidden.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(lse)
        target = torch.empty_like(lse)
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            logits = _chunk_logits(hidden[start:end], weight, temperature)
            local_lse, picked = _local_lse_and_label_logit(logits, labels[start:end] - first)
            if tp_size > 1:  # the whole vocabulary's log-sum-exp from each slice's
                top = local_lse.clone()
                torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX, group=group)
                sums = torch.stack([torch.exp(local_lse - top), picked])
                torch.distributed.all_reduce(sums, group=group)
                lse[start:end], target[start:end] = top + torch.log(sums[0]), sums[1]
            else:
                lse[start:end], target[start:end] = local_lse, picked
            # H = -sum p log p with the global log p: no cancellation of two large terms
            log_p = logits.sub_(lse[start:end, None])
            c = end - start
            part = -torch.bmm(torch.exp(log_p).unsqueeze(1), log_p.unsqueeze(2)).view(c)
            if tp_size > 1:
                torch.distributed.all_reduce(part, group=group)
            entropy[start:end] = part
        ctx.save_for_backward(hidden, weight, labels, lse, entropy)
        ctx.set_materialize_grads(False)  # an output no loss reads gets None, not zeros
        ctx.temperature, ctx.chunk, ctx.first = temperature, chunk, first
        return target - lse, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, labels, lse, entropy = ctx.saved_tensors
        rows, first, t = weight.shape[0], ctx.first, ctx.temperature
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = (
            torch.zeros(rows, hidden.shape[1], dtype=torch.float32, device=hidden.device)
            if ctx.needs_input_grad[1]
            else None
        )
        if rows > 0 and (grad_logprobs is not None or grad_entropy is not None):
            for start in range(0, hidden.shape[0], ctx.chunk):
                end = min(start + ctx.chunk, hidden.shape[0])
                h = hidden[start:end]
                log_p = _chunk_logits(h, weight, t).sub_(lse[start:end, None])
                p = torch.exp(log_p)
                # dL/dl = p * (-g_lp - g_H (log p + H)) + g_lp onehot(y), all over T
                g_lp = grad_logprobs[start:end] / t if grad_logprobs is not None else None
                if grad_entropy is not None:
                    g_h = grad_entropy[start:end, None] / t
                    offset = g_h * entropy[start:end, None]
                    if g_lp is not None:
                        offset = offset + g_lp[:, None]
                    grad = log_p.mul_(-g_h).sub_(offset).mul_(p)
                else:
                    grad = p.mul_(-g_lp[:, None])
                if g_lp is not None:
                    local_label = labels[start:end] - first
                    here = torch.nonzero((local_label >= 0) & (local_label < rows)).squeeze(1)
                    grad[here, local_label[here]] += g_lp[here]
                # the logits were made in the weight's dtype: their gradient is cast back to it
                grad = grad.to(weight.dtype)
                if grad_hidden is not None:
                    grad_hidden[start:end] = grad @ weight
                if grad_weight is not None:
                    grad_weight += (grad.t() @ h).float()
        if grad_weight is not None:
            # padding rows of the projection get no gradient
            grad_weight = torch.nn.functional.pad(grad_weight, (0, 0, 0, ctx.full_rows - rows))
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def _chunk_logits(hidden, weight, temperature: float) -> torch.Tensor:
    """fp32 tempered logits [C, V'] of one chunk over this rank's real vocabulary rows."""
    logits = (hidden @ weight.t()).float()
    return logits if temperature == 1.0 else logits.div_(temperature)


def _local_lse_and_label_logit(logits, local_labels):
    """Over this rank's slice of one chunk's logits [C, V']: the log-sum-exp [C] and each
    label's logit where the slice holds it (else 0)."""
    rows = logits.shape[1]
    if rows == 0:  # a rank holding only vocabulary padding
        zeros = logits.new_zeros(logits.shape[0])
        return torch.full_like(zeros, float("-inf")), zeros
    here = (local_labels >= 0) & (local_labels < rows)
    picked = logits.gather(1, local_labels.clamp(0, rows - 1)[:, None]).squeeze(1)
    return torch.logsumexp(logits, dim=-1), torch.where(here, picked, 0.0)


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
