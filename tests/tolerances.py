"""Tolerances for the tests' numerical comparisons: always relative plus absolute, as
`torch.testing.assert_close` (|a - e| <= atol + rtol * |e|), never an absolute bound alone on
values far from 1. They are fp32 bounds for the tiny model; the measured errors (docs/experiments/
equivalences.md) are 10-100x smaller, and which CPU kernels run (AVX2, AVX-512,
thread count) moves them within that margin."""

import torch

FP32_MODEL = {"rtol": 1e-5, "atol": 1e-5}
"""Outputs of a whole fp32 network (logits, values, scores, gradients) computed two ways:
other TP/PP split, other library, other kernels."""

FP32_EXACT_ORDER = {"rtol": 1e-6, "atol": 1e-6}
"""Two computations that should run the same kernels in the same order (PP=2 vs PP=1)."""

BF16_MODEL = {"rtol": 2e-2, "atol": 5e-2}
"""A bf16 network against fp32 (or another bf16 kernel set): bf16 keeps 8 bits of mantissa."""

LOGPROB = {"rtol": 1e-5, "atol": 1e-4}
"""Per-token log-probs from two engines (vLLM vs Megatron vs HF): O(1-20) nats."""


def assert_close(actual, expected, tol: dict, msg: str | None = None) -> None:
    """torch.testing.assert_close on tensors or lists of floats, with one of the dicts above."""
    actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
    torch.testing.assert_close(
        actual.double(), expected.double(), **tol, msg=(lambda m: f"{msg}: {m}") if msg else None
    )
