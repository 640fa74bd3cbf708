"""Checkpoints of a run: every rank's model, optimizer and RNG state plus the trainer state
(step, stage, data position), written atomically and pruned to the last K.

    output_dir/checkpoints/step_000004/rank_00000.pt ... trainer_state.json, config.yaml
    output_dir/checkpoints/latest   (the name of the newest complete checkpoint)

All ranks write into `.step_N.tmp/`; after a barrier rank 0 renames it to `step_N` and then
updates `latest` (temp file + os.replace), so a directory named step_N is always complete
and a crash leaves at most a `.tmp` directory, which the next save removes. Resuming needs
the same world size and layout (per-rank shards); the HF converters reshard weights.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch


def rng_state() -> dict:
    from megatron.core import tensor_parallel

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "megatron": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _distributed_optimizers(optimizer) -> list:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o for o in parts if isinstance(o, DistributedOptimizer)]


def optimizer_shards(optimizer) -> list[dict]:
    """This rank's shard of a distributed optimizer: fp32 master values and Adam moments.

    megatron's `DistributedOptimizer.state_dict()` leaves them out (megatron-LM saves them
    through a separate sharded path); without them a resume would restart Adam and round the
    masters to bf16. Per rank, so a resume at the same layout is exact. [] otherwise.
    Like `state_dict()`, it refers to the live tensors: save it before the next step.
    """
    return [
        {
            "masters": [[p.detach() for p in g["params"]] for g in o.optimizer.param_groups],
            "inner": o.optimizer.state_dict(),
        }
        for o in _distributed_optimizers(optimizer)
    ]


@torch.no_grad()
def load_optimizer_shards(optimizer, shards: list[dict], path: Path) -> None:
    targets = _distributed_optimizers(optimizer)
    if len(shards) != len(targets):
        raise ValueError(
            f"checkpoint {path}: {len(shards)} distributed-optimizer shards, this run has "
            f"{len(targets)} (actor.optim.use_distributed_optimizer changed?)"
        )
    for o, shard in zip(targets, shards, strict=True):
        o.optimizer.load_state_dict(shard["inner"])
        for group, masters in zip(o.optimizer.param_groups, shard["masters"], strict=True):
            for p, saved in zip(group["params"], masters, strict=True):
                p.copy_(saved)


def role_state(role) -> dict | None:
    if role is None:
        return None
    return {
        "model": [chunk.state_dict() for chunk in role.chunks],
        "optimizer": role.optimizer.state_dict(),
        "optimizer_shards": optimizer_shards(role.optimizer),
    }


def load_role_state(role, state: dict | None, name: str, path: Path) -> None:
    if role is None:
        return
    if state is None:
        raise ValueError(f"checkpoint {path}: has no {name} state but this run trains a {name}")
    for chunk, sd in zip(role.chunks, state["model"], strict=True):
        chunk.load_state_dict(sd)
    role.optimizer.load_state_dict(state["optimizer"])
    load_optimizer_shards(role.optimizer, state.get("optimizer_shards", []), path)


class CheckpointManager:
    def __init__(self, output_dir: str | Path, rank: int, world_size: int, keep_last: int = 2):
        self.root = Path(output_dir) / "checkpoints"
        self.rank, self.world_size, self.keep_last = rank, world_size, keep_last

    def latest(self) -> Path | None:
        pointer = self.root / "latest"
        if not pointer.exists():
            return None
        path = self.root / pointer.read_text().strip()
        return path if (path / "trainer_state.json").exists() else None

    def save(self, step: int, rank_state: dict, trainer_state: dict, config_yaml: str) -> Path:
        name = f"step_{step:06d}"
        tmp = self.root / f".{name}.tmp"
        final = self.root / name
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(".*.tmp"):
                shutil.rmtree(stale)
            tmp.mkdir()
        torch.distributed.barrier()
        torch.save(rank_state, tmp / f"rank_{self.rank:05d}.pt")
        torch.distributed.barrier()
        if self.rank == 0:
            state = {**trainer_state, "world_size": self.world_size}
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
            (tmp / "config.yaml").write_text(config_yaml)
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            pointer = self.root / ".latest.tmp"
            pointer.write_text(name)
            os.replace(pointer, self.root / "latest")
            self._prune()
        torch.distributed.barrier()
        return final

    def _prune(self) -> None:
        done = sorted(p for p in self.root.glob("step_*") if p.is_dir())
        for old in done[: max(0, len(done) - self.keep_last)]:
            shutil.rmtree(old)

    def load(self, path: Path) -> tuple[dict, dict]:
        """(this rank's state, trainer state)."""
        trainer_state = json.loads((path / "trainer_state.json").read_text())
        if trainer_state["world_size"] != self.world_size:
            raise ValueError(
                f"checkpoint {path}: saved by {trainer_state['world_size']} ranks, this run has "
                f"{self.world_size}; resume with the same layout (or convert the weights with "
                "checkpoints_convert and start a new run)"
            )
        rank_file = path / f"rank_{self.rank:05d}.pt"
        if not rank_file.exists():
            raise FileNotFoundError(f"checkpoint {path}: missing {rank_file.name}")
        return torch.load(rank_file, weights_only=False), trainer_state
