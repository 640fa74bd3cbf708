"""Comparing numbers the way `torch.testing.assert_close` does: |a - e| <= atol + rtol * |e|.

An absolute bound alone is wrong for values far from 1: logits of magnitude 50 computed
in fp32 by two kernels differ by ~1e-5 (a relative error of 2e-7), which an atol of 1e-5
rejects on one CPU and accepts on another. Every comparison in code (the converters'
verify, the log-prob checker) and in tests goes through these tolerances.

Pure torch; no process groups.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

# torch.testing.assert_close's defaults, per dtype: rtol ~ the dtype's resolution, atol for
# values near zero. Kept here so tools can print and override them.
_DEFAULTS: dict[torch.dtype, tuple[float, float]] = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
}


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float

    @classmethod
    def for_dtype(cls, dtype: torch.dtype, scale: float = 1.0) -> Tolerance:
        """assert_close's defaults for `dtype`, both multiplied by `scale`: a whole network's
        output accumulates the rounding of many ops, so model-level checks pass scale > 1."""
        if dtype not in _DEFAULTS:
            raise ValueError(f"no default tolerance for dtype {dtype}; pass rtol and atol")
        rtol, atol = _DEFAULTS[dtype]
        return cls(rtol * scale, atol * scale)

    def resolve(self, rtol: float | None, atol: float | None) -> Tolerance:
        """This tolerance with any explicitly given value taking precedence."""
        return Tolerance(self.rtol if rtol is None else rtol, self.atol if atol is None else atol)


@dataclass(frozen=True)
class Comparison:
    """Result of `compare`: the worst errors and whether every element is within tolerance."""

    max_abs_diff: float
    max_rel_diff: float
    """max |a - e| / |e| over elements with e != 0."""
    max_abs_value: float
    mismatched: int
    """elements with |a - e| > atol + rtol * |e| (NaN/inf mismatches count)."""
    numel: int
    rtol: float
    atol: float

    @property
    def ok(self) -> bool:
        return self.mismatched == 0

    def as_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def compare(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance) -> Comparison:
    """Element-wise comparison of two tensors of one shape, computed in float64."""
    if actual.shape != expected.shape:
        raise ValueError(f"shapes differ: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    a, e = actual.detach().double(), expected.detach().double()
    diff = (a - e).abs()
    # equal infinities are a match (inf - inf would be NaN); NaN never is
    diff = torch.where(a == e, torch.zeros_like(diff), diff)
    diff = torch.nan_to_num(diff, nan=float("inf"))
    bound = tol.atol + tol.rtol * e.abs()
    nonzero = e != 0
    rel = diff[nonzero] / e.abs()[nonzero]
    return Comparison(
        max_abs_diff=diff.max().item() if diff.numel() else 0.0,
        max_rel_diff=rel.max().item() if rel.numel() else 0.0,
        max_abs_value=e.abs().max().item() if e.numel() else 0.0,
        mismatched=int((diff > bound).sum().item()),
        numel=diff.numel(),
        rtol=tol.rtol,
        atol=tol.atol,
    )
