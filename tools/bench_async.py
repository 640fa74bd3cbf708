"""Benchmark: time per PPO step with the engines colocated against apart, on the same
cores, from the trainer's own timers.

    python -m tools.bench async [--model runs/demo/tiny-sft-count_on --steps 6 --shape demo|long]

Runs of `examples/tiny/vapo_count_on.yaml` (the demo's recipe: VAPO, 16 prompts x 8
samples) with 2 processes each, one after the other:
- colocated: 2 ranks, TP 2, each rank training and generating in turn (vLLM TP 2): the demo;
- colocated_dp2: 2 ranks, TP 1, DP 2 (one engine each): no TP traffic, as the apart runs,
  so the placement alone separates them;
- disaggregated, synchronous (async.max_staleness=0): rank 0 trains (TP 1), rank 1 generates;
- one-step-off (async.max_staleness=1): the same ranks, step s's rollout generated while
  step s - 1 trains;
- apart_k2: async.max_staleness=2 with partial rollouts (each push read inside the
  engine's round, its responses continued under the new weights).
Reported per run: the median step time over the steps after the first (warm-up) and its
ratio to colocated; for the apart runs also the trainer's wait for rollouts and for the
push (`timing/rollout_s`, `timing/sync_s`). The ideal overlap the phases allow, from the
synchronous apart run: one-step-off can at best take max(generation, training + push) per
step instead of their sum, so `ideal_ratio_k1` = step_k0 / max(rollout_k0, step_k0 -
rollout_k0) bounds what k = 1 can gain over k = 0 on these cores.
`--shape long`: a generation-heavy shape (32 samples per prompt, up to 256 new tokens, the
same number of updates), where generation dominates as it does for long chains of thought.

`--to-bar`: also the time to the demo's bar (`make demo`: held-out accuracy up by
MIN_GAIN = 0.25), per mode: the recipe as the demo runs it (its value pretraining, the warm
start, `--bar-steps` PPO steps) with the recipe's first eval set every `--eval-interval`
steps. `time_to_bar_s` is the trainer's step time summed over the PPO steps up to the first
evaluation at the bar, those evaluations included (the same ones in every mode, made by
the engine ranks when apart; value pretraining, synchronous in every mode, left out). Staleness shows here: an async run may
need more steps than colocated, and this is where that is paid.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from dataclasses import asdict
from pathlib import Path

from examples.demo.demo import MIN_GAIN
from megatron_rl.config import load_config
from megatron_rl.launch import run_torchrun
from tools.bench_common import record

RECIPE = "examples/tiny/vapo_count_on.yaml"
APART = ["rollout.placement=disaggregated", "rollout.engine_ranks=1",
         "parallel.tensor_model_parallel_size=1"]  # fmt: skip
"""One trainer rank (TP 1) and one engine rank."""
MODES = {
    "colocated": [],
    "colocated_dp2": ["parallel.tensor_model_parallel_size=1"],
    "apart_k0": [*APART, "async.max_staleness=0"],
    "apart_k1": [*APART, "async.max_staleness=1"],
    "apart_k2": [*APART, "async.max_staleness=2", "async.partial_rollout=true"],
}
SHAPES = {
    "demo": [],
    # 4 prompts x 32 samples (the demo's 128 sequences), long responses: generation-bound
    "long": ["rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=32",
             "rollout.max_new_tokens=256", "rollout.max_model_len=512"],
}  # fmt: skip


def summary(rows: list[dict]) -> dict[str, float]:
    """Median seconds of the step and of the trainer's waits, over the steps after the
    first."""
    measured = rows[1:]

    def median(key: str) -> float:
        return round(statistics.median(r[key] for r in measured), 3)

    def mean(key: str) -> dict[str, float]:
        """Apart runs only: staleness; with partial rollouts the mixed-version share and
        the share of rounds admitted beside the previous one's tail."""
        if key not in measured[0]:
            return {}
        return {key.removeprefix("rollout/"): round(statistics.fmean(r[key] for r in measured), 3)}

    return {
        "step_s": median("timing/step_s"),
        "rollout_wait_s": median("timing/rollout_s"),
        "sync_s": median("timing/sync_s"),
        "response_length": round(
            statistics.fmean(r["rollout/response_length/mean"] for r in measured), 1
        ),
        **mean("rollout/staleness"),
        **mean("rollout/mixed_version_share"),
        **mean("rollout/interleaved"),
    }


def ideal_ratio_k1(k0: dict[str, float]) -> float:
    """What one-step-off can at best gain over the synchronous apart run: its step is the
    rollout plus the rest; overlapped, the longer of the two."""
    rest = k0["step_s"] - k0["rollout_wait_s"]
    return round(k0["step_s"] / max(k0["rollout_wait_s"], rest), 3)


def to_bar(rows: list[dict], min_gain: float = MIN_GAIN) -> dict:
    """From a run's metrics rows: the first PPO step whose evaluation gained `min_gain` over
    the one before training (step 0), and the trainer's step time summed up to it; None
    for both when no evaluation reached it."""
    (before,) = (r["eval/accuracy"] for r in rows if r["stage"] == "eval" and r["step"] == 0)
    train = [r for r in rows if r["stage"] == "train"]
    evals = [r for r in train if "eval/accuracy" in r]
    reached = next((r["step"] for r in evals if r["eval/accuracy"] >= before + min_gain), None)
    return {
        "accuracy_before": round(before, 3),
        "accuracy_end": round(evals[-1]["eval/accuracy"], 3),
        "steps_to_bar": reached,
        "time_to_bar_s": None
        if reached is None
        else round(sum(r["timing/step_s"] for r in train if r["step"] <= reached), 2),
    }


def train(model: Path, out: Path, overrides: list[str]) -> list[dict]:
    """One run of the recipe on 2 ranks; its metrics rows."""
    args = ["--config", RECIPE, f"model.path={model}", f"trainer.output_dir={out}", *overrides]
    run_torchrun("megatron_rl.cli.train", args, nproc=2, timeout=3600)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="runs/demo/tiny-sft-count_on")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--shape", choices=sorted(SHAPES), default="demo")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset")
    p.add_argument("--out", default="bench/results.jsonl")
    p.add_argument("--note", default="", help="what else ran on these cores, for the record")
    p.add_argument("--to-bar", action="store_true", help="also the time to the demo's bar")
    p.add_argument("--bar-steps", type=int, default=20)
    p.add_argument("--eval-interval", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="trainer.seed of the --to-bar runs")
    a = p.parse_args(argv)
    if a.steps < 3:
        p.error("--steps must be >= 3 (the first step is warm-up)")
    modes = a.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown or "colocated" not in modes:
        p.error(f"--modes: {unknown or 'colocated (the baseline) missing'}; known {list(MODES)}")

    work = Path(tempfile.mkdtemp(prefix="bench_async-"))
    results = {}
    try:
        model = Path(a.model)
        if not (model / "config.json").exists():
            from examples.tiny_model import make_tiny_model

            model = make_tiny_model(work / "tiny-qwen2")
        for mode in modes:
            rows = train(model, work / mode, [
                f"trainer.total_steps={a.steps}", "critic.pretrain_steps=0",
                "trainer.eval_sets=[]", *SHAPES[a.shape], *MODES[mode],
            ])  # fmt: skip
            results[mode] = summary([r for r in rows if r["stage"] == "train"])
        if a.to_bar:
            # the recipe's first eval set alone (JSON is YAML: one override)
            first = json.dumps(asdict(load_config(RECIPE).trainer.eval_sets[0]))
            for mode in modes:
                rows = train(model, work / f"{mode}-bar", [
                    f"trainer.total_steps={a.bar_steps}", f"trainer.seed={a.seed}",
                    f"trainer.eval_sets=[{first}]", f"trainer.eval_interval={a.eval_interval}",
                    *SHAPES[a.shape], *MODES[mode],
                ])  # fmt: skip
                results[mode].update(to_bar(rows))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = results["colocated"]["step_s"]
    base_bar = results["colocated"].get("time_to_bar_s")
    for r in results.values():
        r["ratio_to_colocated"] = round(base / r["step_s"], 3)
        if base_bar is not None and r["time_to_bar_s"] is not None:
            r["time_to_bar_ratio"] = round(base_bar / r["time_to_bar_s"], 3)
    line = {
        "recipe": RECIPE,
        "shape": a.shape,
        "model": str(a.model) if model == Path(a.model) else "fresh tiny random",
        "steps_measured": a.steps - 1,
        **({"note": a.note} if a.note else {}),
        **({"to_bar": {"min_gain": MIN_GAIN, "steps": a.bar_steps, "seed": a.seed,
                       "eval_interval": a.eval_interval}} if a.to_bar else {}),
        **results,
    }  # fmt: skip
    if "apart_k0" in results:
        line["ideal_ratio_k1_over_k0"] = ideal_ratio_k1(results["apart_k0"])
    record("async", line, a.out)


if __name__ == "__main__":
    main()
