"""Step metrics: printed as a progress line, appended to metrics.jsonl and sent to the
`trainer.logger` backends (`trainer/loggers.py`); evaluation results, one row per eval set and
evaluation, in eval.jsonl.

Every part of a step computes its metrics under the name they are logged by, in the convention
of verl and OpenRLHF: `actor/...` (policy loss, clip fractions, entropy, grad norm, the
reward's KL), `critic/...` (`vf_loss`, `vf_explained_var`, values: only with a critic),
`algorithm/...` (advantages, returns, the policy's GAE lambda), `rollout/...` (reward,
accuracy, response length, generation, the engine-trainer log-prob gap), `rollout_corr/...`,
`timing/...`, `perf/...` (throughput, DP balance), `memory/...`, `eval/...`. A role's update
reports bare names (`pg_loss`, `vf_loss`) that the trainer files under the role's namespace."""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.trainer.loggers import make_backends


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


CONSOLE_KEYS = (
    "rollout/reward/mean",
    "rollout/accuracy",
    "actor/pg_loss",
    "critic/vf_loss",
    "critic/vf_explained_var",
    "actor/reward_kl",
    "eval/accuracy",
    "eval/teacher/accuracy",
)
"""The few numbers the console shows per step; the rest are in the logs."""
SUMMARY_KEYS = (
    "rollout/reward/mean", "rollout/accuracy", "eval/accuracy", "rollout/response_length/mean",
    "actor/entropy", "critic/vf_explained_var", "actor/grad_norm", "timing/step_s",
)  # fmt: skip


@dataclass(frozen=True)
class LoggerConfig:
    """What `trainer.logger` and the run's names ask of `MetricsLogger`."""

    loggers: tuple[str, ...] = ("console", "jsonl")
    project: str = "megatron_rl"
    run_name: str = "run"
    config: dict | None = None
    """The resolved config, logged once by each backend."""
    step_offset: int = 0
    """Value-pretraining steps: PPO step s is x = step_offset + s on the backends' one axis."""


class MetricsLogger:
    """Rank 0 logs (`enabled`); metrics.jsonl is always written (resume, `tools/plot_run.py`
    and the demo read it), the console and the `trainer.logger` backends as configured."""

    def __init__(
        self,
        *,
        output_dir: str | Path,
        total_steps: int,
        enabled: bool,
        settings: LoggerConfig = LoggerConfig(),
    ):
        self.enabled = enabled
        self.total_steps = total_steps
        self.settings = settings
        self.console = "console" in settings.loggers
        self.start = time.time()
        self.history: list[tuple[str, int, dict]] = []
        if not enabled:
            return
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.file = open(self.dir / "metrics.jsonl", "a")  # noqa: SIM115 (kept open for the run)
        self.backends = make_backends(
            settings.loggers, self.dir, settings.config or {}, settings.run_name, settings.project
        )

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
        self.history.append((stage, step, metrics))
        x = step if stage == "value_pretrain" else self.settings.step_offset + step
        for backend in self.backends:
            backend.log(x, metrics, stage)
        if self.console:
            self.progress(step, metrics, stage, total or self.total_steps)

    def progress(self, step: int, metrics: dict, stage: str, total: int) -> None:
        elapsed = time.time() - self.start
        done = min(step / max(total, 1), 1.0)
        bar = "#" * int(20 * done) + "." * (20 - int(20 * done))
        shown = " ".join(f"{k}={metrics[k]:.4g}" for k in CONSOLE_KEYS if k in metrics)
        print(f"[{bar}] {stage} step {step}/{total} {elapsed:.0f}s {shown}", flush=True)

    def summary(self) -> str:
        """A table of the run's key metrics as this process logged them: first, last, min,
        max over the steps (eval rows included), and where the full logs are."""
        rows = []
        for key in SUMMARY_KEYS:
            values = [m[key] for stage, _, m in self.history
                      if stage != "value_pretrain" and isinstance(m.get(key), (int, float))
                      and math.isfinite(m[key])]  # fmt: skip
            if values:
                rows.append((key, values[0], values[-1], min(values), max(values)))
        if not rows:
            return ""
        width = max(len(r[0]) for r in rows)
        lines = [f"{'metric':<{width}}  {'first':>9}  {'last':>9}  {'min':>9}  {'max':>9}"]
        lines += [f"{k:<{width}}" + "".join(f"  {v:>9.4g}" for v in vals) for k, *vals in rows]
        lines.append(f"logs: {self.dir / 'metrics.jsonl'} ({time.time() - self.start:.0f} s)")
        return "\n".join(lines)

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
        if not self.enabled:
            return
        self.file.close()
        for backend in self.backends:
            backend.close()
        if self.console and self.history:
            print(self.summary(), flush=True)
