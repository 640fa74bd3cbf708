"""Reading the trainer's checkpoints in tests, without a process group."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from megatron_rl.models.dist_checkpoint import OPTIMIZER_KEY


def role_tensors(step_dir: Path, role: str) -> dict[str, torch.Tensor] | None:
    """The full (unsharded) tensors of a role's distributed checkpoint in `step_dir`: the
    model's by megatron name, the optimizer's under "optimizer."; None if the role is absent."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    model_dir = Path(step_dir) / role / "model"
    if not model_dir.is_dir():
        return None
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(model_dir, Path(tmp) / "full.pt")
        state = torch.load(Path(tmp) / "full.pt", weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def model_weights(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in tensors.items() if not OPTIMIZER_KEY.match(k)}


def same_weights(a: dict | None, b: dict | None) -> bool:
    """Two roles' model tensors are bit-for-bit equal."""
    a, b = model_weights(a), model_weights(b)
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
