"""Input validation shared by the algorithm functions.

Every check raises ValueError naming the argument and what was expected, so a bad batch
fails at the first function that sees it rather than as a NaN three steps later.
"""

from __future__ import annotations

import torch


def check_mask(mask: torch.Tensor, name: str = "response_mask") -> None:
    """A [B, T] tensor of zeros and ones (any dtype).

    On the host a bad value raises ValueError naming it. On an accelerator the values are
    checked on the device (`torch._assert_async`): reading them back would make the host wait
    for the device in every micro-batch's loss. A bad mask there stops the run with a
    device-side assertion at the device's next synchronisation; batches are built on the
    host (`data/batch.py`), where their masks are made of zeros and ones."""
    if mask.dim() != 2:
        raise ValueError(f"{name} must be [B, T], got shape {tuple(mask.shape)}")
    bad = (mask != 0) & (mask != 1)
    if mask.device.type != "cpu":
        torch._assert_async(~bad.any(), f"{name} must contain only 0 and 1")
        return
    if bad.any():
        value = mask[bad].flatten()[0].item()
        raise ValueError(f"{name} must contain only 0 and 1, found {value}")


def check_same_shape(name: str, x: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if x.shape != ref.shape:
        raise ValueError(
            f"{name} has shape {tuple(x.shape)}, expected {tuple(ref.shape)} like {ref_name}"
        )


def check_per_sequence(name: str, x: torch.Tensor, mask: torch.Tensor) -> None:
    """A [B] tensor matching the batch of a [B, T] mask."""
    if x.dim() != 1 or x.shape[0] != mask.shape[0]:
        raise ValueError(
            f"{name} must be [B] with B={mask.shape[0]} (one per response), got {tuple(x.shape)}"
        )


def check_finite(name: str, x: torch.Tensor, mask: torch.Tensor | None = None) -> None:
    """No NaN/inf where it counts (inside the mask, if one is given)."""
    bad = ~torch.isfinite(x)
    if mask is not None:
        bad = bad & (mask != 0)
    if bad.any():
        idx = bad.nonzero()[0].tolist()
        raise ValueError(f"{name} has a non-finite value {x[tuple(idx)].item()} at index {idx}")


def check_groups(group_index: torch.Tensor | None, batch: int, estimator: str) -> torch.Tensor:
    """Group ids [B] (one per response, responses of a prompt share an id); every group >= 2."""
    if group_index is None:
        raise ValueError(f"{estimator} needs group_index ([B] prompt ids): it compares samples")
    if group_index.dim() != 1 or group_index.shape[0] != batch:
        raise ValueError(
            f"group_index must be [B] with B={batch}, got shape {tuple(group_index.shape)}"
        )
    _, counts = torch.unique(group_index, return_counts=True)
    if (counts < 2).any():
        raise ValueError(
            f"{estimator} needs G >= 2 samples per prompt; group sizes found: "
            f"{sorted(set(counts.tolist()))}"
        )
    return group_index
