"""Checkpoints of a run: every rank's model, optimizer and RNG state plus the trainer state
(step, stage, data position), written atomically and pruned to the last K.

    output_dir/checkpoints/step_000004/rank_00000.pt ... trainer_state.json, config.yaml
    output_dir/checkpoints/latest   (the name of the newest complete checkpoint)

All ranks write into `.step_N.tmp/`; after a barrier rank 0 renames it to `step_N` and then
updates `latest` (temp file + os.replace), so a directory named step_N is always complete
and a crash leaves at most a `.tmp` directory (or a `.latest.tmp` pointer), which the next
save removes. Pruning keeps the newest `keep_last` checkpoints up to the one just saved
(never that one, never a later one).
A checkpoint a rank cannot read is named (file and rank), moved aside to `.step_N.corrupt`,
and the previous complete one is used. Resuming needs the same world size and layout
(per-rank shards); the HF converters reshard weights.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from megatron_rl.workers.optimizer import apply_hyperparameters


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
    changed = apply_hyperparameters(role.optimizer, role.optim)
    if changed and torch.distributed.get_rank() == 0:
        print(
            f"resume: {name} optimizer settings from the config, not {path}: " + ", ".join(changed),
            flush=True,
        )


class CorruptCheckpoint(RuntimeError):
    """A rank file of a complete checkpoint cannot be read (truncated, missing, not torch)."""


STEP_DIR = re.compile(r"step_\d+")


def checkpoint_step(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


def previous_run_files(output_dir: str | Path) -> list[Path]:
    """What an earlier run left in `output_dir` that a new run would mix with its own."""
    out = Path(output_dir)
    found = [out / "metrics.jsonl"] if (out / "metrics.jsonl").exists() else []
    root = out / "checkpoints"
    if root.is_dir():
        found += sorted(p for p in root.iterdir() if STEP_DIR.fullmatch(p.name))
    return found


def clear_previous_run(output_dir: str | Path) -> None:
    """`trainer.overwrite`: remove the checkpoints, metrics and TensorBoard logs of a run."""
    out = Path(output_dir)
    for d in (out / "checkpoints", out / "tensorboard"):
        shutil.rmtree(d, ignore_errors=True)
    (out / "metrics.jsonl").unlink(missing_ok=True)


class CheckpointManager:
    def __init__(
        self,
        output_dir: str | Path,
        rank: int,
        world_size: int,
        keep_last: int = 2,
        layout: dict | None = None,
    ):
        """`layout`: the parallel sizes the shards depend on (saved, and checked on load)."""
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.root = Path(output_dir) / "checkpoints"
        self.rank, self.world_size, self.keep_last = rank, world_size, keep_last
        self.layout = layout

    def complete(self) -> list[Path]:
        """Complete checkpoints (renamed from .tmp, trainer state written), oldest first."""
        if not self.root.is_dir():
            return []
        done = [
            p
            for p in self.root.iterdir()
            if STEP_DIR.fullmatch(p.name) and (p / "trainer_state.json").exists()
        ]
        return sorted(done, key=checkpoint_step)

    def latest(self) -> Path | None:
        """The checkpoint `latest` names, else (a pointer to a missing or incomplete one,
        or none) the newest complete one, with a warning."""
        pointer = self.root / "latest"
        complete = self.complete()
        if pointer.exists():
            path = self.root / pointer.read_text().strip()
            if path in complete:
                return path
            if self.rank == 0:
                newest = complete[-1] if complete else None
                print(
                    f"warning: {pointer} names {path.name}, which is not a complete "
                    f"checkpoint; using {newest or 'none (a fresh start)'}",
                    flush=True,
                )
        return complete[-1] if complete else None

    def previous(self, path: Path) -> Path | None:
        """The newest complete checkpoint older than `path`."""
        older = [p for p in self.complete() if checkpoint_step(p) < checkpoint_step(path)]
        return older[-1] if older else None

    def set_aside(self, path: Path) -> Path:
        """Rank 0: move a corrupt checkpoint out of the way (kept for inspection)."""
        aside = path.with_name(f".{path.name}.corrupt")
        if aside.exists():
            shutil.rmtree(aside)
        path.rename(aside)
        return aside

    def save(self, step: int, rank_state: dict, trainer_state: dict, config_yaml: str) -> Path:
        name = f"step_{step:06d}"
        tmp = self.root / f".{name}.tmp"
        final = self.root / name
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(".*.tmp"):  # a save that was killed
                shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
            tmp.mkdir()
        torch.distributed.barrier()
        torch.save(rank_state, tmp / f"rank_{self.rank:05d}.pt")
        torch.distributed.barrier()
        if self.rank == 0:
            state = {**trainer_state, "world_size": self.world_size, "layout": self.layout}
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
            (tmp / "config.yaml").write_text(config_yaml)
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            pointer = self.root / ".latest.tmp"
            pointer.write_text(name)
            os.replace(pointer, self.root / "latest")
            self._prune(final)
        torch.distributed.barrier()
        return final

    def _prune(self, saved: Path) -> None:
        """Keep the newest `keep_last` checkpoints up to `saved` (which `latest` names);
        a later one is not this run's lineage and is left alone."""
        mine = [p for p in self.complete() if checkpoint_step(p) <= checkpoint_step(saved)]
        for old in mine[: max(0, len(mine) - self.keep_last)]:
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
        saved = trainer_state.get("layout")  # absent in checkpoints written before it was
        if saved is not None and self.layout is not None and saved != self.layout:
            diff = ", ".join(
                f"{k} {saved.get(k)} -> {v}" for k, v in self.layout.items() if saved.get(k) != v
            )
            raise ValueError(
                f"checkpoint {path}: saved at another parallel layout ({diff}); its per-rank "
                "shards only load at the layout that wrote them: resume with the saved layout "
                "(or convert the weights with checkpoints_convert and start a new run)"
            )
        rank_file = path / f"rank_{self.rank:05d}.pt"
        try:
            return torch.load(rank_file, weights_only=False), trainer_state
        except Exception as e:  # truncated, missing, not a torch file: all mean unreadable
            raise CorruptCheckpoint(
                f"checkpoint {path}: {rank_file.name} (rank {self.rank}) cannot be read: "
                f"{type(e).__name__}: {e}"
            ) from e
