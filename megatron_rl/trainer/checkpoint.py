"""Checkpoints of a run: each role's model and optimizer as a megatron-core distributed
checkpoint (reshards on load: resume at another TP/PP/DP layout; exports with
`checkpoints_convert.megatron_to_hf`), every rank's RNG state, and the trainer state (step,
stage, data position), written atomically and pruned to the last K.

    output_dir/checkpoints/step_000004/actor/   megatron_rl.json, model/, hf_meta/,
                                               lr_scheduler.json
                                      critic/  (when trained)
                                      rng/rank_00000.pt ...
                                      trainer_state.json, config.yaml
    output_dir/checkpoints/latest   (the name of the newest complete checkpoint)

All ranks write into `.step_N.tmp/`; after a barrier rank 0 renames it to `step_N` and then
updates `latest` (temp file + os.replace), so a directory named step_N is always complete
and a crash leaves at most a `.tmp` directory (or a `.latest.tmp` pointer), which the next
save removes. Pruning keeps the newest `keep_last` checkpoints up to the one just saved
(never that one, never a later one).
A checkpoint a rank cannot read is named (file and rank), moved aside to `.step_N.corrupt`,
and the previous complete one is used. At another layout the RNG states are not restored
(they are per rank); the weights, Adam moments, step and data position are.
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
from torch.distributed.checkpoint.api import CheckpointException

from megatron_rl.models.dist_checkpoint import (
    HF_META_SUBDIR,
    METADATA,
    MODEL_SUBDIR,
    copy_side_files,
    load_role,
    save_role,
    write_metadata,
)
from megatron_rl.models.lora import LORA_METADATA
from megatron_rl.models.source import ModelSource
from megatron_rl.workers.optimizer import apply_hyperparameters, restore_schedule

LR_SCHEDULER = "lr_scheduler.json"
"""A role's learning-rate schedule: its update count and what it was configured with."""


def rng_state() -> dict:
    # megatron loads only where it is used (CLI start-up, --help and config errors stay fast)
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
    # megatron loads only where it is used (CLI start-up, --help and config errors stay fast)
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_roles(out: Path, roles: dict, sources: dict[str, str], layout: dict | None) -> None:
    """Each trained role (name -> TrainableRole or None) as `out/<name>/`: a megatron
    distributed checkpoint of its model and optimizer (`models.dist_checkpoint`), with the
    metadata and Hugging Face side files `checkpoints_convert.megatron_to_hf` exports from,
    and its learning-rate schedule."""
    for name, role in roles.items():
        if role is None:
            continue
        save_role(role.chunks, role.optimizer, out / name)
        if torch.distributed.get_rank() == 0:
            lora = {LORA_METADATA: role.lora.to_dict()} if role.lora else {}
            write_metadata(
                out / name, name, role.arch, saved_layout=layout, source=sources[name], **lora
            )
            (out / name / LR_SCHEDULER).write_text(json.dumps(role.scheduler.state_dict()) + "\n")
            copy_side_files(ModelSource(sources[name]).hf_dir, out / name / HF_META_SUBDIR)


def load_roles(path: Path, roles: dict) -> None:
    """Load each role at this run's layout (any TP/PP/DP: the shards reshard); the config's
    optimizer settings replace the checkpoint's, and each change is printed; the learning-rate
    schedule continues from the checkpoint's update count. An unreadable role directory is a
    CorruptCheckpoint naming it."""
    for name, role in roles.items():
        if role is None:
            continue
        if not (path / name / METADATA).exists():
            raise ValueError(f"checkpoint {path}: has no {name} state but this run trains a {name}")
        check_same_adapters(path / name, role.lora)
        role.restore_offloaded()  # a checkpoint loads into the state where it trains
        try:
            load_role(role.chunks, role.optimizer, path / name)
        # A truncated or missing shard file: the checkpoint is unusable. torch's
        # CheckpointException (raised on every rank) derives from BaseException.
        except (Exception, CheckpointException) as e:
            raise CorruptCheckpoint(
                f"checkpoint {path}: {name}/{MODEL_SUBDIR} cannot be read "
                f"(rank {torch.distributed.get_rank()}): {type(e).__name__}: {e}"
            ) from e
        changed = apply_hyperparameters(role.optimizer, role.optim)
        schedule = path / name / LR_SCHEDULER
        saved = json.loads(schedule.read_text()) if schedule.exists() else None
        changed += restore_schedule(role.scheduler, saved)
        if saved is None and torch.distributed.get_rank() == 0:
            print(
                f"resume: {path}/{name} has no {LR_SCHEDULER} (saved before learning-rate "
                "schedules): the schedule starts at update 0",
                flush=True,
            )
        if changed and torch.distributed.get_rank() == 0:
            print(
                f"resume: {name} optimizer settings from the config, not {path}: "
                + ", ".join(changed),
                flush=True,
            )


def check_same_adapters(role_dir: Path, lora) -> None:
    """A checkpoint resumes only into the same adapters (or none): a LoRA checkpoint holds
    the adapters alone, a full one every weight (verl's `check_adapter_matches_config`)."""
    saved = json.loads((role_dir / METADATA).read_text()).get(LORA_METADATA)
    wanted = lora.to_dict() if lora else None
    keys = ("rank", "alpha", "target_modules", "use_rslora")
    if (saved is None) != (wanted is None) or (saved and any(saved[k] != wanted[k] for k in keys)):
        raise ValueError(
            f"checkpoint {role_dir}: saved with lora {saved}, this run has lora {wanted}: "
            f"resume with the same adapters ({', '.join(keys)})"
        )


class CorruptCheckpoint(RuntimeError):
    """A rank file of a complete checkpoint cannot be read (truncated, missing, not torch)."""


STEP_DIR = re.compile(r"step_\d+")
HF_EXPORTS = "hf"
"""output_dir/hf/step_N: the actor as a Hugging Face model (`trainer.save_hf_interval`)."""


def checkpoint_step(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


def previous_run_files(output_dir: str | Path) -> list[Path]:
    """What an earlier run left in `output_dir` that a new run would mix with its own."""
    out = Path(output_dir)
    found = [out / f for f in ("metrics.jsonl", "eval.jsonl") if (out / f).exists()]
    for root in (out / "checkpoints", out / HF_EXPORTS):
        if root.is_dir():
            found += sorted(p for p in root.iterdir() if STEP_DIR.fullmatch(p.name))
    return found


def save_hf_export(out: Path, write) -> None:
    """`write(tmp)` (a collective) fills `.step_N.tmp` beside `out`; rank 0 then replaces
    `out` with it, so `out` is always a whole model (a redone step's export is replaced)."""
    tmp = out.with_name(f".{out.name}.tmp")
    if torch.distributed.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    torch.distributed.barrier()
    write(tmp)
    if torch.distributed.get_rank() == 0:
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    torch.distributed.barrier()


def clear_previous_run(output_dir: str | Path) -> None:
    """`trainer.overwrite`: remove the checkpoints, HF exports, metrics, evaluations, memory
    timeline and TensorBoard logs of a run."""
    out = Path(output_dir)
    for d in (out / "checkpoints", out / HF_EXPORTS, out / "tensorboard"):
        shutil.rmtree(d, ignore_errors=True)
    for f in ("metrics.jsonl", "eval.jsonl", "memory_timeline.jsonl"):
        (out / f).unlink(missing_ok=True)


class CheckpointManager:
    def __init__(
        self,
        *,
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

    def path(self, step: int) -> Path:
        """Where the checkpoint of `step` is (or would be) once complete."""
        return self.root / f"step_{step:06d}"

    def save(
        self, step: int, write_roles, rng: dict, trainer_state: dict, config_yaml: str
    ) -> Path:
        """`write_roles(dir)`: every rank writes the roles' distributed checkpoints there."""
        final = self.path(step)
        name = final.name
        tmp = self.root / f".{name}.tmp"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(".*.tmp"):  # a save that was killed
                shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
            tmp.mkdir()
            (tmp / "rng").mkdir()
        torch.distributed.barrier()
        write_roles(tmp)
        torch.save(rng, tmp / "rng" / f"rank_{self.rank:05d}.pt")
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

    def load(self, path: Path) -> tuple[dict | None, dict]:
        """(this rank's RNG state, or None when the run's layout differs from the saved one;
        the trainer state). The roles load separately (`load_roles`), at any layout."""
        trainer_state = json.loads((path / "trainer_state.json").read_text())
        if (path / "rank_00000.pt").exists():
            raise ValueError(
                f"checkpoint {path}: per-rank torch files (rank_*.pt) of megatron_rl before "
                "distributed checkpoints; this version cannot read them: finish that run with "
                "the version that wrote it, or start a new run from its Hugging Face model"
            )
        saved = (trainer_state["world_size"], trainer_state.get("layout"))
        if saved != (self.world_size, self.layout):
            if self.rank == 0:
                print(
                    f"resume: {path} was saved by {saved[0]} ranks at {saved[1]}, this run has "
                    f"{self.world_size} at {self.layout}: weights and optimizer state reshard; "
                    "the per-rank RNG states are not restored (the run's seed stands)",
                    flush=True,
                )
            return None, trainer_state
        rng_file = path / "rng" / f"rank_{self.rank:05d}.pt"
        try:
            return torch.load(rng_file, weights_only=False), trainer_state
        except Exception as e:  # truncated, missing, not a torch file: all mean unreadable
            raise CorruptCheckpoint(
                f"checkpoint {path}: rng/{rng_file.name} (rank {self.rank}) cannot be read: "
                f"{type(e).__name__}: {e}"
            ) from e
