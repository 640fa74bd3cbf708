"""Step metrics: reduced over ranks, printed as a progress line, appended to metrics.jsonl,
and written to TensorBoard when it is installed; evaluation results, one row per eval set
and evaluation, in eval.jsonl."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path


def row_position(record: dict) -> tuple[int, float]:
    """Where a metrics.jsonl row was logged in a run: value pretraining steps, then PPO steps;
    the separate step-0 evaluation row comes after the checkpoint that ends value pretraining
    (a resume at step 0 runs it again)."""
    if record["stage"] == "value_pretrain":
        return (0, record["step"])
    return (1, record["step"] + (0.5 if record["stage"] == "eval" else 0.0))


def eval_row_position(record: dict) -> tuple[int, float]:
    """An eval.jsonl row sits where its metrics row does: the evaluation before training
    after the checkpoint that ends value pretraining, a later step's before its checkpoint."""
    return row_position({"stage": "eval" if record["step"] == 0 else "train", **record})


def rewind_jsonl(path: Path, keep) -> int:
    """Keep the rows of `path` for which keep(row) holds (temp file + rename); how many
    were dropped."""
    if not path.exists():
        return 0
    lines = path.read_text().splitlines(keepends=True)
    kept = [ln for ln in lines if ln.strip() and keep(json.loads(ln))]
    if len(kept) != len(lines):
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)
    return len(lines) - len(kept)


class MetricsLogger:
    def __init__(self, output_dir: str | Path, total_steps: int, enabled: bool, tensorboard: bool):
        self.enabled = enabled
        self.total_steps = total_steps
        self.start = time.time()
        self.writer = None
        if not enabled:
            return
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.file = open(self.dir / "metrics.jsonl", "a")  # noqa: SIM115 (kept open for the run)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(self.dir / "tensorboard"))
            except ImportError:
                print("metrics: tensorboard is not installed; logging to metrics.jsonl only")

    def log(
        self, step: int, metrics: dict[str, float], stage: str = "train", total: int | None = None
    ) -> None:
        if not self.enabled:
            return
        # NaN/Inf (e.g. explained variance of constant returns) as null: strict JSON.
        clean = {
            k: (v if not isinstance(v, float) or math.isfinite(v) else None)
            for k, v in metrics.items()
        }
        record = {"step": step, "stage": stage, **clean}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.writer is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.writer.add_scalar(f"{stage}/{k}", v, step)
        elapsed = time.time() - self.start
        total = total or self.total_steps
        done = min(step / max(total, 1), 1.0)
        bar = "#" * int(20 * done) + "." * (20 - int(20 * done))
        shown = " ".join(
            f"{k}={metrics[k]:.4g}"
            for k in (
                "reward/mean",
                "accuracy",
                "pg_loss",
                "critic/value_loss",
                "critic/explained_variance",
                "kl",
                "eval/accuracy",
            )
            if k in metrics
        )
        print(
            f"[{bar}] {stage} step {step}/{total} {elapsed:.0f}s {shown}",
            file=sys.stdout,
            flush=True,
        )

    def log_eval(self, step: int, rows: list[dict]) -> None:
        """One eval.jsonl row per eval set: {step, set, n, temperature, prompts, avg@n,
        pass@k..., reward_mean, response_length/mean}."""
        if not self.enabled or not rows:
            return
        with open(self.dir / "eval.jsonl", "a") as f:
            f.writelines(json.dumps({"step": step, **row}) + "\n" for row in rows)

    def rewind(self, position: tuple[int, float]) -> int:
        """On resume: drop the rows logged after the checkpoint at `position` (the run redoes
        those steps, so each step keeps one row), in metrics.jsonl and eval.jsonl. Returns
        how many metrics rows were dropped."""
        if not self.enabled:
            return 0
        self.file.close()
        rewind_jsonl(self.dir / "eval.jsonl", lambda r: eval_row_position(r) <= position)
        dropped = rewind_jsonl(self.dir / "metrics.jsonl", lambda r: row_position(r) <= position)
        self.file = open(self.dir / "metrics.jsonl", "a")  # noqa: SIM115 (kept open for the run)
        return dropped

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            if self.writer is not None:
                self.writer.close()
