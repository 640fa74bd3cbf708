"""Benchmark: where one RL step of the tiny demo goes (generate / score / experience / train /
weight sync), from the trainer's own timers.

    python -m tools.bench step_breakdown [--model runs/demo/tiny-sft-sums --steps 5]

Runs `examples/tiny/vapo.yaml` (2 torchrun ranks, TP=2, real vLLM, the math reward) for
--steps PPO steps without value pretraining or evaluation, reads `metrics.jsonl`, and reports
the mean seconds of each phase over the steps after the first (warm-up), and each phase's
share of the step (one JSON line, appended to --out). Phases: vLLM generation, scoring (the
rest of the rollout: rewards inline or waiting for the Ray pool, decoding, filtering),
experience (old log-probs and values: forward passes), PPO updates of actor and critic, and
the Megatron -> vLLM weight sync.
The model defaults to the demo's warm-started one when `make demo` made it, else a fresh
tiny random one (its responses are longer: they rarely stop).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path

from megatron_rl.launch import run_torchrun
from tools.bench_common import record

PHASES = ("generate", "score", "experience", "train", "sync")


def phase_seconds(r: dict) -> dict[str, float]:
    """One step's phases from the trainer's timers. `score` is the rollout minus generation:
    scoring inline, or waiting for the Ray pool, plus decoding and filtering."""
    return {
        "generate": r["timing/generate_s"],
        "score": r["timing/rollout_s"] - r["timing/generate_s"],
        "experience": r["timing/experience_s"],
        "train": r["timing/train_s"],
        "sync": r["timing/sync_s"],
    }


def breakdown(records: list[dict]) -> dict:
    """Mean seconds per phase over `records` (trainer metrics) and shares of the mean step.
    The trainer's timers partition the step, and means (unlike medians) add up: the shares
    sum to 1."""
    phases = [phase_seconds(r) for r in records]
    mean = {name: statistics.fmean(p[name] for p in phases) for name in PHASES}
    step = statistics.fmean(r["timing/step_s"] for r in records)
    out = {"step_s": round(step, 3)}
    out.update({f"{k}_s": round(v, 3) for k, v in mean.items()})
    out.update({f"{k}_share": round(v / step, 3) for k, v in mean.items()})
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="runs/demo/tiny-sft-sums")
    p.add_argument("--config", default="examples/tiny/vapo.yaml")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default="bench/results.jsonl")
    a = p.parse_args(argv)
    if a.steps < 2:
        p.error("--steps must be >= 2 (the first step is warm-up)")

    work = Path(tempfile.mkdtemp(prefix="bench_step-"))
    try:
        model = Path(a.model)
        if not (model / "config.json").exists():
            from examples.tiny_model import make_tiny_model

            model = make_tiny_model(work / "tiny-qwen2")
        out = work / "run"
        args = [
            "--config", a.config, f"model.path={model}", f"trainer.output_dir={out}",
            f"trainer.total_steps={a.steps}", "critic.pretrain_steps=0",
            "trainer.eval_data_path=null",
        ]  # fmt: skip
        run_torchrun("megatron_rl.cli.train", args, nproc=2, timeout=1800)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in rows if r["stage"] == "train"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    record(
        "step_breakdown",
        {
            "config": a.config,
            "model": str(a.model) if model == Path(a.model) else "fresh tiny random",
            "steps_measured": len(train) - 1,
            "mean_response_length": round(
                statistics.mean(r["rollout/response_length/mean"] for r in train[1:]), 2
            ),
            **breakdown(train[1:]),
        },
        a.out,
    )


if __name__ == "__main__":
    main()
