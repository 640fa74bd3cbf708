"""Masked reductions over [B, T] tensors, and moments that can be reduced across ranks.

No torch.distributed here: a caller that needs global statistics builds `Moments.of(x, mask)`
on each rank, all-reduces `moments.as_tensor()` (a sum), and passes
`Moments.from_tensor(reduced)` back into `masked_whiten` or an estimator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Sum of x where the 0/1 mask is 1. Padded entries may hold anything, NaN included:
    they are selected out, never multiplied by 0."""
    x = torch.where(mask.bool(), x, 0)
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean of x where mask is 1; 0 (not NaN) where the mask is empty."""
    count = mask.to(x.dtype).sum() if dim is None else mask.to(x.dtype).sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


@dataclass(frozen=True)
class Moments:
    """Count, sum and sum of squares of the valid entries: additive across ranks."""

    count: torch.Tensor
    total: torch.Tensor
    total_sq: torch.Tensor

    @classmethod
    def of(cls, x: torch.Tensor, mask: torch.Tensor) -> Moments:
        x = x.double()
        return cls(mask.double().sum(), masked_sum(x, mask), masked_sum(x * x, mask))

    def as_tensor(self) -> torch.Tensor:
        """[3] float64 tensor to all-reduce (SUM)."""
        return torch.stack([self.count, self.total, self.total_sq])

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> Moments:
        return cls(t[0], t[1], t[2])

    @property
    def mean(self) -> torch.Tensor:
        return self.total / self.count.clamp(min=1)

    @property
    def var(self) -> torch.Tensor:
        """Unbiased (Bessel-corrected) variance; 0 with fewer than two entries."""
        n = self.count
        centered = (self.total_sq - self.total * self.total / n.clamp(min=1)).clamp(min=0)
        return torch.where(n > 1, centered / (n - 1).clamp(min=1), torch.zeros_like(n))


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unbiased variance of the valid entries (scalar, float64)."""
    return Moments.of(x, mask).var


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    stats: Moments | None = None,
    eps: float = 1e-8,
) -> torch.Tensor:
    """(x - mean) / (std + eps) over valid entries; padded entries become 0.

    `stats` are the global moments when the batch is split over ranks; None uses this batch.
    """
    stats = stats or Moments.of(x, mask)
    mean, std = stats.mean.to(x.dtype), stats.var.sqrt().to(x.dtype)
    out = (x - mean) / (std + eps)
    return torch.where(mask.bool(), out, torch.zeros_like(out))
