"""The chunked head's per-tile maths written for the compiler. Backward: on CUDA,
`torch.compile` turns it into one fused kernel that reads a chunk's [C, V'] fp32 logits (or
the probabilities forward kept in the weight's dtype: `kept_probs_grad`) once and writes the
logits' gradient in the weight's dtype. Forward, where a run asks for it
(`model.use_fused_kernels`): `tile_sums`, a tile's max, sums and label logit, and the kept
probabilities, in one kernel where the eager sums make ten passes over the tile (twelve
keeping its probabilities).

`parallel.vocab._chunk_logits_grad`, the eager form, works in place to hold few chunk-sized
tensors, but each of its steps (shift, multiply-add, exp, multiply, the labels' fix-up) is
a kernel of its own. Measured on an H200 (bench/gpu.md, 2026-11-28): compiled, a 441-token
chunk of Qwen2.5's 152k vocabulary takes 0.24 ms. The forward's sums are left eager unless
a run asks: compiled they became one reduction kernel per chunk at 9.8 ms (441 rows of 152k
columns, before the head took tiles of thousands of rows each way), slower than the eager
passes; the next GPU window measures the tiles' (`bench/gpu.md`).

The maths is `vocab._ChunkedLogProbsEntropy`'s; CPU tests hold the forms equal (the forward's
compiled too, by the CPU's compiler), the GPU test the compiled ones to fp32 logits.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

FELL_BACK: list[str] = []
"""The functions whose compiled form failed in this process and run eager since (`FallBack`):
`tools.bench train_step` reports them, so a compiled arm that ran eager is not read as the
compiled kernels' speed."""

LOG_FLOOR = -1.0e4
"""log of a kept exp(l - m) that underflowed to 0 is -inf; floored here, its probability
is still 0 while -g_h (log p + H) stays finite (0 * inf would be NaN)."""


def tile_sums(
    logits: torch.Tensor,
    local_labels: torch.Tensor,
    kept: torch.Tensor | None,
    calculate_entropy: bool,
) -> torch.Tensor:
    """[4, C]: `vocab._chunk_sums` of one tile of tempered fp32 logits [C, R] (not consumed):
    the max m, s = sum exp(l - m), d = sum exp(l - m) (l - m) (0 without
    `calculate_entropy`) and each label's logit where the tile's rows hold it (else 0);
    exp(l - m) written into `kept` [C, R] where given, in its dtype. Compiled, the max is one
    loop over each row and the rest a second, which writes nothing of the tile's size but
    `kept` (on a GPU a row of 8,192 fp32 is read back from L2)."""
    m = logits.amax(dim=-1)
    shifted = logits - m[:, None]
    e = torch.exp(shifted)
    if kept is not None:
        kept.copy_(e)
    s = e.sum(dim=-1)
    d = (e * shifted).sum(dim=-1) if calculate_entropy else torch.zeros_like(s)
    cols = torch.arange(logits.shape[1], device=logits.device)
    picked = torch.where(cols[None, :] == local_labels[:, None], logits, 0.0).sum(dim=-1)
    return torch.stack([m, s, d, picked])


def chunk_logits_grad(
    raw: torch.Tensor,
    lse: torch.Tensor,
    g_lp: torch.Tensor,
    g_h: torch.Tensor,
    entropy: torch.Tensor,
    local_labels: torch.Tensor,
    temperature: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """dL/dl [C, V'] in `dtype` from the untempered fp32 logits raw, the log-sum-exp and
    entropy [C], and the per-token gradients g_lp, g_h [C] (already over T; zeros for a
    term no loss reads): p * (-g_h (log p + H) - g_lp) + g_lp onehot(y), the one-hot term
    added in fp32 before the one rounding (a comparison inside the pass: no host
    synchronisation). `vocab._chunk_logits_grad`, fused."""
    at_label = _at_label(raw, local_labels)
    return _grad_of_log_p(raw / temperature - lse[:, None], at_label, g_lp, g_h, entropy, dtype)


def kept_probs_grad(
    kept: torch.Tensor,
    shift: torch.Tensor,
    g_lp: torch.Tensor,
    g_h: torch.Tensor,
    entropy: torch.Tensor,
    local_labels: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The same dL/dl from the forward's kept exp(l - m_block) [C, V'] instead of the logits:
    log p = log(kept) + shift, shift = m_block - log-sum-exp [C]. `vocab._kept_log_p` then
    `vocab._chunk_logits_grad`, fused."""
    log_p = torch.log(kept.float()).clamp(min=LOG_FLOOR) + shift[:, None]
    return _grad_of_log_p(log_p, _at_label(kept, local_labels), g_lp, g_h, entropy, dtype)


def _at_label(tile: torch.Tensor, local_labels: torch.Tensor) -> torch.Tensor:
    """[C, V'] bool: each token's label column, where this tile's rows hold it."""
    cols = torch.arange(tile.shape[1], device=tile.device)
    return cols[None, :] == local_labels[:, None]


def _grad_of_log_p(log_p, at_label, g_lp, g_h, entropy, dtype):
    factor = -g_h[:, None] * (log_p + entropy[:, None]) - g_lp[:, None]
    return (torch.exp(log_p) * factor + torch.where(at_label, g_lp[:, None], 0.0)).to(dtype)


@functools.cache
def compiled_grad(device_type: str) -> Callable[..., torch.Tensor] | None:
    """`chunk_logits_grad` compiled for `device_type`, or None where it is not: off CUDA
    (compiling on CPU costs each process seconds that the eager form does not lose there),
    without Triton, or where a first compilation on small tensors fails (said once, in the
    log; the eager form then serves)."""
    return _compiled(
        chunk_logits_grad,
        device_type,
        lambda tile, vec, labels: (tile, vec, vec, vec, vec, labels, 1.0, torch.bfloat16),
    )


@functools.cache
def compiled_kept_grad(device_type: str) -> Callable[..., torch.Tensor] | None:
    """`kept_probs_grad` compiled as `compiled_grad` is."""
    return _compiled(
        kept_probs_grad,
        device_type,
        lambda tile, vec, labels: (tile.bfloat16(), -vec, vec, vec, vec, labels, torch.bfloat16),
    )


@functools.cache
def compiled_sums(device_type: str) -> Callable[..., torch.Tensor] | None:
    """`tile_sums` compiled for `device_type`: on CUDA by Triton, on the CPU by its C++
    compiler (a run asks for it: `model.use_fused_kernels`), or None where that fails (said
    once, in the log; the eager sums then serve)."""
    return _compiled(
        tile_sums,
        device_type,
        lambda tile, vec, labels: (tile, labels, tile.bfloat16(), True),
        cpu=True,
    )


def _compiled(fn, device_type: str, example, cpu: bool = False) -> FallBack | None:
    """`fn` compiled, tried once on small tensors: `example(tile [4, 8], vec [4], labels)`
    gives its arguments; eager again if a later call fails (`FallBack`). Off CUDA only with
    `cpu` (compiling there costs each process seconds, which the backward's eager form does
    not lose)."""
    if device_type not in (("cuda", "cpu") if cpu else ("cuda",)):
        return None
    if device_type == "cuda":
        # why: torch's Triton probe imports its inductor utilities, which only CUDA needs
        from torch.utils._triton import has_triton

        if not has_triton():
            log.warning("chunked log-probs: no Triton, the head's maths runs unfused")
            return None
    fused = torch.compile(fn, dynamic=True, fullgraph=True)
    try:
        tile = torch.rand(4, 8, device=device_type) + 0.1
        vec = torch.ones(4, device=device_type)
        labels = torch.tensor([0, 3, 7, 9], device=device_type)
        fused(*example(tile, vec, labels))
    except Exception as e:  # noqa: BLE001 - any compiler failure: fall back, said once
        log.warning("chunked log-probs: torch.compile failed (%s); the maths runs unfused", e)
        return None
    return FallBack(fused, fn)


class FallBack:
    """A compiled function that hands its call, and every later one, to the eager `fn` (the
    same maths and signature, unfused) the first time it fails: the probe of `_compiled`
    compiles one small case, a run meets others (dtypes, strides, arguments that are one
    tensor, the recompile limit of `fullgraph`). Said once, in the log. Running out of
    memory is not the compiler's failure: it is raised."""

    def __init__(self, fused: Callable[..., torch.Tensor], fn: Callable[..., torch.Tensor]):
        self.fused, self.fn = fused, fn

    def __call__(self, *args):
        if self.fused is not None:
            try:
                return self.fused(*args)
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # noqa: BLE001 - any compiler failure: eager from now on
                log.warning(
                    "chunked log-probs: the compiled %s failed (%s); it runs unfused from now on",
                    self.fn.__name__,
                    e,
                )
                self.fused = None
                FELL_BACK.append(self.fn.__name__)
        return self.fn(*args)
