"""The chunked head's backward maths written for the compiler: on CUDA, `torch.compile`
turns it into one fused kernel that reads a chunk's [C, V'] fp32 logits once and writes the
logits' gradient in the weight's dtype.

`parallel.vocab._chunk_logits_grad`, the eager form, works in place to hold few chunk-sized
tensors, but each of its steps (shift, multiply-add, exp, multiply, the labels' fix-up) is
a kernel of its own. Measured on an H200 (bench/gpu.md, 2026-11-28): compiled, a 441-token
chunk of Qwen2.5's 152k vocabulary takes 0.24 ms. The forward's reductions are left eager:
compiled they became one reduction kernel per chunk at 9.8 ms (441 rows of 152k columns:
too few rows to fill the GPU), slower than the eager passes.

The maths is `vocab._ChunkedLogProbsEntropy`'s; a CPU test holds the two forms equal, the GPU
test the compiled one to fp32 logits.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


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
    log_p = raw / temperature - lse[:, None]
    cols = torch.arange(raw.shape[1], device=raw.device)
    at_label = torch.where(cols[None, :] == local_labels[:, None], g_lp[:, None], 0.0)
    factor = -g_h[:, None] * (log_p + entropy[:, None]) - g_lp[:, None]
    return (torch.exp(log_p) * factor + at_label).to(dtype)


@functools.cache
def compiled_grad(device_type: str) -> Callable[..., torch.Tensor] | None:
    """`chunk_logits_grad` compiled for `device_type`, or None where it is not: off CUDA
    (compiling on CPU costs each process seconds that the eager form does not lose there),
    without Triton, or where a first compilation on small tensors fails (said once, in the
    log; the eager form then serves)."""
    if device_type != "cuda":
        return None
    # why: torch's Triton probe imports its inductor utilities, which only CUDA needs
    from torch.utils._triton import has_triton

    if not has_triton():
        log.warning("chunked log-probs: no Triton, the backward's maths runs unfused")
        return None
    fused = torch.compile(chunk_logits_grad, dynamic=True, fullgraph=True)
    try:
        vec = torch.ones(4, device=device_type)
        labels = torch.tensor([0, 3, 7, 9], device=device_type)
        fused(
            torch.randn(4, 8, device=device_type), vec, vec, vec, vec, labels, 1.0, torch.bfloat16
        )
    except Exception as e:  # noqa: BLE001 - any compiler failure: fall back, said once
        log.warning("chunked log-probs: torch.compile failed (%s); the maths runs unfused", e)
        return None
    return fused
