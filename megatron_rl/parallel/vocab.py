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

import functools
import warnings

import torch

from megatron_rl.parallel import vocab_fused
from megatron_rl.parallel.tiles import tile_shape


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


def _rescaled(m, s, d, top):
    """A slice's sums (s = sum exp(l - m), d = sum exp(l - m) (l - m)) taken relative to the
    larger max `top` instead of its own m: terms to add to other slices' at that max."""
    scale = torch.exp(m - top)  # 0 for a slice with no rows (m = -inf)
    shift = torch.where(s > 0, m - top, 0.0)  # -inf * 0 would be NaN
    return scale * s, scale * (d + shift * s)


class _ChunkedLogProbsEntropy(torch.autograd.Function):
    """Log-probs of labels and entropy of softmax(hidden @ W^T / T), tile by tile over tokens
    and vocabulary rows, never holding more than one tile's [C, R] logits: forward keeps only
    the per-token log-sum-exp and entropy, backward recomputes each tile's logits (Liger's
    fused linear cross-entropy, Hsu et al. 2024, extended to entropy, vocabulary blocks and
    vocabulary parallelism; `tile_shape` says why tiles, not token chunks).

    With l the tempered logits, m = max l, s = sum exp(l - m), d = sum exp(l - m) (l - m):
      log-sum-exp = m + log s;   H = -sum p log p = log s - d / s;
      d log p(y) / d l = onehot(y) - p;   d H / d l = -p * (log p + H).
    Both terms of H are >= 0 (s >= 1, d <= 0): no cancellation. Blocks of rows, and under TP
    the ranks' slices, each sum s and d at their own max; the sums are rescaled to the larger
    max and added (`_rescaled`), the ranks' in one all-reduce. Backward needs no collective
    once the log-sum-exp is the global one: the hidden states' gradient is this slice's
    partial sum, reduced over TP by whatever made `hidden` (`models/lm_head.py`), as
    megatron's output layer does. Vocabulary padding (megatron pads to a multiple of 128 x TP)
    is left out of the product, so it takes no probability mass and gets no gradient.

    Elementwise passes over a tile's logits, not its GEMMs, are what such a head costs on a
    GPU (a [C, R] fp32 pass moves 4 C R bytes; the GEMM's FLOPs per byte are ~hidden / 2), so
    each tile takes as few as the maths allows: forward max, shift, exp, a sum, and a
    product in place and its sum; backward shift, one multiply-add, exp and one multiply
    written straight in the weight's dtype, or on CUDA the same maths compiled into one pass
    (`vocab_fused`). Both gradients accumulate in fp32 (inside the GEMM on CUDA: `_gemm_into`)
    and are rounded to the weight's dtype once.

    With `keep_probs` forward also keeps each tile's exp(l - m_block) in the weight's dtype
    ([tokens, V'] in all: half the bytes of bf16 training's fp32 logits) with the blocks'
    maxima, and backward reads log p from them instead of recomputing the tile's GEMM: one
    GEMM of the head's three in backward saved (a twelfth of a 0.5B model's GEMM FLOPs at a
    152k vocabulary) for the kept bytes. Rounding them to bf16 loses nothing where it
    would matter: a probability near 1, whose gradient 1 - p would cancel, is its block's
    largest, whose kept exp(0) = 1 is exact.
    """

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        labels,
        vocab_size,
        temperature,
        tile,
        calculate_entropy,
        keep_probs,
        compiled_sums,
    ):
        rank, tp_size, group = _tp()
        ctx.full_rows = weight.shape[0]
        first = rank * weight.shape[0]
        weight = weight[: max(0, min(weight.shape[0], vocab_size - first))]  # real rows only
        n, rows = hidden.shape[0], weight.shape[0]
        chunk, block = tile
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(lse) if calculate_entropy else None
        target = torch.empty_like(lse)
        kept = block_max = None
        if keep_probs and rows > 0:
            kept = torch.empty(n, rows, dtype=weight.dtype, device=hidden.device)
            block_max = lse.new_empty(-(-rows // block), n)
        fused = vocab_fused.compiled_sums(hidden.device.type) if compiled_sums else None
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            h, local_labels = hidden[start:end], labels[start:end] - first
            m, s, d, picked = _row_block_sums(
                h,
                weight,
                local_labels,
                temperature,
                block,
                calculate_entropy,
                kept=None if kept is None else kept[start:end],
                block_max=None if kept is None else block_max[:, start:end],
                fused=fused,
            )
            if tp_size > 1:  # every slice's sums, rescaled to the global max
                top = m.clone()
                torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX, group=group)
                sums = torch.stack([*_rescaled(m, s, d, top), picked])
                torch.distributed.all_reduce(sums, group=group)
                m, (s, d, picked) = top, sums
            log_s = torch.log(s)
            lse[start:end], target[start:end] = m + log_s, picked
            if calculate_entropy:
                entropy[start:end] = log_s - d / s
        ctx.save_for_backward(hidden, weight, labels, lse, entropy, kept, block_max)
        ctx.set_materialize_grads(False)  # an output no loss reads gets None, not zeros
        ctx.temperature, ctx.tile, ctx.first = temperature, tile, first
        return target - lse, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, labels, lse, entropy, kept, block_max = ctx.saved_tensors
        (rows, h_size), first, t = weight.shape, ctx.first, ctx.temperature
        chunk, block = ctx.tile
        n = hidden.shape[0]
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        # fp32, padding rows included (they get no gradient), rounded to the weight's dtype once
        grad_weight = (
            torch.zeros(ctx.full_rows, h_size, dtype=torch.float32, device=hidden.device)
            if ctx.needs_input_grad[1]
            else None
        )
        if rows > 0 and (grad_logprobs is not None or grad_entropy is not None):
            if kept is None:
                fused = vocab_fused.compiled_grad(hidden.device.type)
            else:
                fused = vocab_fused.compiled_kept_grad(hidden.device.type)
            # the hidden states' gradient summed over blocks of rows: in fp32 where they are not
            summed = grad_hidden is not None and rows > block and hidden.dtype != torch.float32
            acc = hidden.new_empty(min(chunk, n), h_size, dtype=torch.float32) if summed else None
            for start in range(0, n, chunk):
                end = min(start + chunk, n)
                h, local_labels = hidden[start:end], labels[start:end] - first
                g_lp = None if grad_logprobs is None else grad_logprobs[start:end] / t
                g_h = None if grad_entropy is None else grad_entropy[start:end] / t
                if fused is not None:
                    zeros = lse.new_zeros(end - start)
                    g_lp, g_h = (zeros if g is None else g for g in (g_lp, g_h))
                    entropy_here = zeros if entropy is None else entropy[start:end]
                into = None
                if grad_hidden is not None:
                    into = acc[: end - start] if summed else grad_hidden[start:end]
                for i, row in enumerate(range(0, rows, block)):
                    w, labels_here = weight[row : row + block], local_labels - row
                    if kept is not None:  # log p from the kept exp(l - m_block), no GEMM
                        tile = kept[start:end, row : row + block]
                        shift = block_max[i, start:end] - lse[start:end]
                        if fused is not None:
                            grad = fused(
                                tile, shift, g_lp, g_h, entropy_here, labels_here, weight.dtype
                            )
                        else:
                            log_p = _kept_log_p(tile, shift)
                    elif fused is not None:
                        grad = fused(
                            _chunk_logits(h, w, 1.0),
                            lse[start:end],
                            g_lp,
                            g_h,
                            entropy_here,
                            labels_here,
                            t,
                            weight.dtype,
                        )
                    else:
                        log_p = _chunk_logits(h, w, t).sub_(lse[start:end, None])
                    if fused is None:
                        grad = _chunk_logits_grad(
                            log_p,
                            g_lp,
                            g_h,
                            None if g_h is None else entropy[start:end],
                            labels_here,
                            weight.dtype,
                        )
                    if into is not None:
                        _gemm_into(into, grad, w, accumulate=row > 0)
                    if grad_weight is not None:
                        _gemm_into(grad_weight[row : row + w.shape[0]], grad.t(), h, start > 0)
                if summed:
                    grad_hidden[start:end] = into
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def _row_block_sums(
    h,
    weight,
    local_labels,
    temperature: float,
    block: int,
    calculate_entropy: bool = True,
    kept: torch.Tensor | None = None,
    block_max: torch.Tensor | None = None,
    fused=None,
):
    """(m, s, d, picked), each [C], of the tokens `h` [C, h] over all of `weight`'s rows, a
    block of `block` rows at a time (`_chunk_sums`, or `fused`: `vocab_fused.tile_sums`
    compiled; d = 0 without `calculate_entropy`). Each
    block writes its four sums into one [4, blocks, C] buffer, rescaled to their common max
    once at the end: a handful of ops per block, launched from the host, where merging block
    by block took twice as many. With `kept` [C, rows] each block also writes its
    exp(l - m_block) there, and `block_max` [blocks, C] gets the blocks' maxima."""
    rows = weight.shape[0]
    starts = range(0, max(rows, 1), block)  # one empty block where no rows are real
    sums = torch.empty(4, len(starts), h.shape[0], dtype=torch.float32, device=h.device)
    for i, row in enumerate(starts):
        logits = _chunk_logits(h, weight[row : row + block], temperature)
        labels_here = local_labels - row if row else local_labels
        kept_here = None if kept is None else kept[:, row : row + block]
        if fused is not None and logits.shape[1] > 0:
            sums[:, i] = fused(logits, labels_here, kept_here, calculate_entropy)
        else:
            _chunk_sums(
                logits,
                labels_here,
                out=sums[:, i],
                calculate_entropy=calculate_entropy,
                kept=kept_here,
            )
    if block_max is not None:
        block_max.copy_(sums[0])
    if len(starts) == 1:
        return sums[:, 0].unbind(0)
    m, s, d, picked = sums
    top = m.amax(dim=0)
    s, d = _rescaled(m, s, d, top)
    return top, s.sum(dim=0), d.sum(dim=0), picked.sum(dim=0)  # one block holds each label


def _chunk_sums(logits, local_labels, out=None, calculate_entropy: bool = True, kept=None):
    """Over one tile of fp32 logits [C, R] (consumed): the max m, s = sum exp(l - m),
    d = sum exp(l - m) (l - m) (0 without `calculate_entropy`, which saves a product and a
    sum over the tile, four of its eleven passes with the GEMM's) and each label's logit where
    the tile's rows hold it (else 0), each [C], written into the rows of `out` [4, C] (new
    where None). exp(l - m) is also written into `kept` [C, R] where given (in its dtype; the
    sums are taken in fp32 before that rounding)."""
    c, rows = logits.shape
    if out is None:
        out = logits.new_empty(4, c)
    m, s, d, picked = out.unbind(0)
    if rows == 0:  # a rank holding only vocabulary padding
        m.fill_(float("-inf"))
        out[1:].zero_()
        return m, s, d, picked
    here = (local_labels >= 0) & (local_labels < rows)
    label_logits = logits.gather(1, local_labels.clamp(0, rows - 1)[:, None]).squeeze(1)
    torch.mul(label_logits, here, out=picked)  # finite logits: x * 0 = 0
    torch.amax(logits, dim=-1, out=m)
    shifted = logits.sub_(m[:, None])
    if kept is not None and kept.dtype == logits.dtype:
        e = torch.exp(shifted, out=kept)
    else:
        e = torch.exp(shifted) if calculate_entropy else shifted.exp_()
        if kept is not None:
            kept.copy_(e)
    torch.sum(e, dim=-1, out=s)
    if not calculate_entropy:
        d.zero_()
        return m, s, d, picked
    # a product in place and a sum: a batched GEMV (bmm) reads the two at a fraction of the
    # bandwidth (0.49 ms a 441 x 152k chunk on an H200) and is slower on CPU too; the
    # product goes into the shifted logits, which nothing reads after its sum
    torch.sum(shifted.mul_(e), dim=-1, out=d)
    return m, s, d, picked


def _kept_log_p(kept, shift):
    """fp32 log p [C, R] of one tile from its kept exp(l - m_block) [C, R] and
    shift = m_block - log-sum-exp [C]."""
    log_p = torch.log(kept) if kept.dtype == torch.float32 else kept.float().log_()
    return log_p.clamp_(min=vocab_fused.LOG_FLOOR).add_(shift[:, None])


def _chunk_logits_grad(log_p, g_lp, g_h, entropy, local_labels, dtype):
    """dL/dl for one chunk, in `dtype`, from its log-probs [C, V'] (consumed) and the
    per-token gradients of the log-prob g_lp and of the entropy g_h ([C] or None, already
    over T):  p * (-g_h (log p + H) - g_lp) + g_lp onehot(y).

    The one-hot term is added in fp32 to its entries before their one rounding to `dtype`."""
    c, rows = log_p.shape
    if g_h is not None:
        offset = g_h * entropy
        if g_lp is not None:
            offset = offset + g_lp
        factor = torch.addcmul(-offset[:, None], log_p, -g_h[:, None])  # new [C, V']
        p = log_p.exp_()
    else:
        p = log_p.exp_()
        factor = -g_lp[:, None]
    grad = torch.empty((c, rows), dtype=dtype, device=log_p.device)
    if g_lp is not None:  # the label entries, in fp32, before p and factor are consumed
        # Every token's entry at its label's column, or at column 0 where its label lies in
        # another block of rows (rewritten as p * factor there): no host read of which.
        here = (local_labels >= 0) & (local_labels < rows)
        tokens = torch.arange(c, device=log_p.device)
        cols = local_labels.clamp(0, rows - 1)
        at_label = p[tokens, cols] * (factor[tokens, cols] if g_h is not None else factor[:, 0])
        at_label = torch.where(here, at_label + g_lp, at_label)
    torch.mul(p, factor, out=grad)
    if g_lp is not None:
        grad[tokens, cols] = at_label.to(dtype)
    return grad


@functools.cache
def _fp32_gemm(device_type: str, dtype: torch.dtype) -> bool:
    """Whether a GEMM of `dtype` inputs can write fp32 into a given tensor, summing into it
    (`torch.mm` / `torch.addmm` with `out_dtype=` and `out=`: CUDA only, bf16 / fp16).
    Probed once: a torch without it takes the cast instead (each GEMM's output rounded to
    `dtype` first, and a copy per tile), and says so."""
    if device_type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    try:
        a = torch.ones(2, 2, dtype=dtype, device=device_type)
        out = torch.zeros(2, 2, device=device_type)
        torch.mm(a, a, out_dtype=torch.float32, out=out)
        torch.addmm(out, a, a, out_dtype=torch.float32, out=out)
        works = bool((out == 4).all())
    except (RuntimeError, NotImplementedError, TypeError):
        works = False
    if not works:
        warnings.warn(
            f"torch {torch.__version__} has no {dtype} GEMM writing fp32 in place "
            "(mm / addmm with out_dtype= and out=): the log-prob head's logits and each "
            f"tile's gradient products are rounded to {dtype}, then cast to fp32",
            stacklevel=2,
        )
    return works


def _chunk_logits(hidden, weight, temperature: float) -> torch.Tensor:
    """fp32 tempered logits [C, R] of one tile: these tokens over these vocabulary rows."""
    if _fp32_gemm(hidden.device.type, hidden.dtype):
        logits = torch.mm(hidden, weight.t(), out_dtype=torch.float32)
    else:
        logits = (hidden @ weight.t()).float()
    return logits if temperature == 1.0 else logits.div_(temperature)


def _gemm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    """out = a @ b, or out += a @ b with `accumulate`, in place in out's dtype: an fp32 `out`
    of bf16 / fp16 products is summed inside the GEMM where it can write fp32."""
    if out.dtype == a.dtype:
        if accumulate:
            torch.addmm(out, a, b, out=out)
        else:
            torch.mm(a, b, out=out)
    elif _fp32_gemm(a.device.type, a.dtype):
        if accumulate:
            torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
        else:
            torch.mm(a, b, out_dtype=out.dtype, out=out)
    elif accumulate:
        out.add_(a @ b)
    else:
        out.copy_(a @ b)


def chunked_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    temperature: float = 1.0,
    tile: tuple[int, int] | None = None,
    calculate_entropy: bool = True,
    keep_probs: bool = False,
    compiled_sums: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(labels), entropy) under softmax(hidden @ weight^T / temperature), without ever
    materialising the [tokens, V/tp] logits: a tile of (tokens, vocabulary rows) at a time
    (default `tiles.tile_shape`: `TILE_ELEMENTS` fp32 logits), recomputed in backward.

    hidden: [..., h] (the output layer's input, whole sequence, in the weight's dtype);
    weight: [V/tp, h] this TP rank's vocabulary slice; labels: [...] ids < vocab_size.
    Returns two fp32 tensors shaped like `labels`, equal to `vocab_parallel_logprobs` and
    `vocab_parallel_entropy` of the full logits, gradients included; the entropy is None
    without `calculate_entropy` (verl's name), which spares each tile a product and a sum
    (the log-probs of a rollout's old policy, reference or teacher need no entropy).
    `keep_probs` keeps each tile's probabilities, [tokens, V/tp] in the weight's dtype, from
    forward to backward instead of recomputing the logits (`_ChunkedLogProbsEntropy`); only
    where a gradient can flow (never under `torch.no_grad()`). `compiled_sums` takes each
    tile's forward sums (and kept probabilities) in one compiled kernel
    (`vocab_fused.tile_sums`; the eager passes where it does not compile).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    if tile is not None and min(tile) < 1:
        raise ValueError(f"a tile of the chunked head is (tokens, rows) >= 1, got {tile}")
    shape = labels.shape
    logprobs, entropy = _ChunkedLogProbsEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]).to(weight.dtype),
        weight,
        labels.reshape(-1),
        vocab_size,
        temperature,
        tile or tile_shape(labels.numel(), weight.shape[0]),
        calculate_entropy,
        keep_probs and torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad),
        compiled_sums,
    )
    return logprobs.view(shape), None if entropy is None else entropy.view(shape)
