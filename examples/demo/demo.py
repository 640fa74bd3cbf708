"""`make demo`: tiny VAPO runs that learn, end to end on 2 CPU ranks (about 8 minutes).

1. build the tiny random Qwen2 checkpoint (HF format) if it is not there yet;
2. supervised warm start on the task's worked solutions (`examples.demo.sft`): the format
   and an imperfect procedure, not every answer;
3. for each seed (`--seeds 0,1,2`): VAPO (the task's recipe under torchrun, TP=2): value
   pretraining, then 20 PPO steps with the math verifier's +1/-1 reward; accuracy on the
   held-out file before training and every 5 steps (`eval/accuracy`: the recipe's first
   eval set; avg@4 at temperature 1, as the paper reports AIME avg@32; greedy for `sums`);
4. `runs/demo/reward_curve.png`: train reward and held-out accuracy per seed;
5. a table of accuracy before/after and the critic's explained variance at the end of value
   pretraining per seed (the trainer warns below 0.3); exit 1 unless every seed gained at least
   `--min-gain` (0.25): the claim is a gain with a margin on every seed, not a number to the
   digit, because CPU kernels round differently from machine to machine.

Tasks (`--task`, TASKS): `tool_sums`, five-digit sums with a code interpreter:
multi-turn rollouts where the warm start calls the tool in ~40% of its samples and RL must
find that the tool is what earns the reward (the tool calls per trajectory are printed too);
`count_on` (the default), sums answered either by counting on
("37+6=38+5=...=43+0. The answer is \\boxed{43}.") or by counting all from 1 ("1,2,3,...",
cut off before the answer in the warm start's solutions), 20-62 tokens decided at the first
one: what value pretraining, lambda_critic = 1 and length-adaptive GAE are for (the critic
explains 0.4-0.7 of the returns' variance after 10 steps); `chains`, the same sums always
counted on, where the return hinges on slips spread over the chain (a critic explains ~0 of
it, the ceiling being 0.32: docs/experiments/demo.md); `sums`, the earlier single-digit sums
answered in ~9 tokens (`examples/tiny/vapo.yaml`, an 80-step warm start: longer supervised
training there is chaotic, the accuracy it ends at differed between CPUs' kernels by up to
0.5).

On-policy distillation (`--distill examples/tiny/distill_count_on.yaml`: the teacher's
signal alone; `--distill examples/tiny/distill_reward_count_on.yaml`: added to GRPO's task
advantages; both in `make demo`): after the recipe's first seed, its last actor checkpoint
is the teacher of a distillation run from the same warm start on every seed, which
evaluates the teacher too at every evaluation (`teacher.evaluate`: `eval/teacher/accuracy`,
with the student's seeds); the table beside gives each arm's steps and wall time to the pass
mark and to the teacher's accuracy. Every arm must gain `--min-gain` on every seed.

`--smoke` runs the older stack check instead: a Megatron TP=2 forward/backward against
Hugging Face, and a vLLM generation.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from examples.demo.tasks import TASKS, DemoTask
from examples.demo.tp_step import demo_batch, next_token_loss
from examples.tiny_model import TinyModelSpec, make_tiny_model
from megatron_rl.config import load_config
from megatron_rl.launch import run_torchrun
from megatron_rl.parallel.distributed import pin_threads
from megatron_rl.rollout.types import EngineConfig, SamplingConfig
from megatron_rl.rollout.vllm_engine import VLLMEngine
from megatron_rl.trainer.value_pretrain import settled_explained_variance

DEFAULT_DIR = Path("runs/demo")
MIN_GAIN = 0.25
"""Held-out accuracy every seed must gain for the demo to pass: a margin well above what
machine-to-machine differences in CPU rounding move a run by."""


def ensure_tiny_model(path: Path, chat_template: str = "chatml") -> Path:
    if (path / "config.json").exists():
        return path
    return make_tiny_model(path, TinyModelSpec(chat_template=chat_template))


def megatron_step(model_dir: Path) -> dict:
    result = run_torchrun(
        "examples.demo.tp_step", ["--hf-dir", str(model_dir), "--tp", "2"], timeout=600
    )
    lines = [ln for ln in result.output.splitlines() if ln.startswith('{"layout"')]
    if len(lines) != 1:
        raise RuntimeError(f"the TP=2 step printed no result line; output:\n{result.output}")
    return json.loads(lines[0])


def hf_reference_loss(model_dir: Path) -> float:
    # why: transformers takes seconds to import: only this path needs it
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokens = demo_batch(model.config.vocab_size)
    with torch.no_grad():
        return next_token_loss(model(tokens).logits, tokens).item()


def vllm_generation(model_dir: Path, n: int) -> dict:
    # why: transformers takes seconds to import: only this path needs it
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    questions = ["What is 12 + 30?", "What is 7 * 6?"]
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)[
            "input_ids"
        ]
        for q in questions
    ]
    sampling = SamplingConfig(n=n, max_new_tokens=32)
    t0 = time.perf_counter()
    engine = VLLMEngine(model_dir, EngineConfig(seed=0, max_model_len=512))
    t1 = time.perf_counter()
    engine.generate(prompts, sampling)  # the first call pays one-off kernel warm-up
    t2 = time.perf_counter()
    samples = engine.generate(prompts, sampling)
    t3 = time.perf_counter()
    tokens = sum(s.response_length for s in samples)
    return {
        "engine_start_s": round(t1 - t0, 2),
        "first_generate_s": round(t2 - t1, 2),
        "prompts": len(prompts),
        "samples": len(samples),
        "generated_tokens": tokens,
        "tokens_per_s": round(tokens / (t3 - t2), 1),
        "mean_logprob": round(sum(sum(s.logprobs) for s in samples) / tokens, 4),
        "first_sample": {
            "prompt_index": samples[0].prompt_index,
            "finish_reason": samples[0].finish_reason,
            "text": tokenizer.decode(samples[0].token_ids)[:80],
        },
    }


def smoke(model_dir: Path, n: int) -> None:
    step = megatron_step(model_dir)
    ref = hf_reference_loss(model_dir)
    step["hf_loss"] = round(ref, 6)
    step["abs_diff_vs_hf"] = abs(step["loss"] - ref)
    print("Megatron TP=2 forward/backward:", json.dumps(step))
    if not math.isclose(step["loss"], ref, rel_tol=1e-5, abs_tol=1e-5) or not step["grads_finite"]:
        raise SystemExit(
            "Megatron TP=2 loss disagrees with Hugging Face, or gradients are not finite"
        )
    gen = vllm_generation(model_dir, n)
    print("vLLM generation:", json.dumps(gen))
    if gen["samples"] != gen["prompts"] * n:
        raise SystemExit(f"expected {gen['prompts'] * n} samples, got {gen['samples']}")
    print("smoke run OK")


def warm_start(
    model_dir: Path, out: Path, task: DemoTask, threads: int, steps: int | None = None
) -> None:
    subprocess.run(
        [
            sys.executable, "-m", "examples.demo.sft", "--model", str(model_dir),
            "--data", task.sft_data, "--out", str(out), "--steps", str(steps or task.sft_steps),
            "--lr", str(task.sft_lr), "--batch-size", "32", "--threads", str(threads),
            "--label-key", task.sft_label_key, "--response-template", task.response_template,
        ],
        check=True,
    )  # fmt: skip


def run_rl(
    recipe: str, model_dir: Path, out: Path, seed: int, overrides=(), echo: bool = True
) -> None:
    if out.exists():
        shutil.rmtree(out)  # a fresh run, not a resume
    args = [
        "--config",
        recipe,
        f"model.path={model_dir}",
        f"trainer.output_dir={out}",
        f"trainer.seed={seed}",
        *overrides,
    ]
    run_torchrun("megatron_rl.cli.train", args, nproc=2, timeout=1200, echo=echo)


def read_curves(metrics_file: Path) -> dict:
    """Per step: train reward mean, and held-out accuracy (`eval/accuracy`) where it was
    evaluated; and the critic's explained variance where value pretraining ended (the mean of
    its last steps, `settled_explained_variance`; None without value pretraining)."""

    records = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    train = [r for r in records if r["stage"] == "train"]
    evals = {r["step"]: r["eval/accuracy"] for r in records if r["stage"] == "eval"}  # step 0
    evals.update({r["step"]: r["eval/accuracy"] for r in train if "eval/accuracy" in r})
    # the teacher's accuracy at each evaluation, on the student's draws (`teacher.evaluate`)
    teacher = {r["step"]: r["eval/teacher/accuracy"] for r in records
               if "eval/teacher/accuracy" in r}  # fmt: skip
    pretrain = [r.get("critic/vf_explained_var") for r in records if r["stage"] == "value_pretrain"]
    pretrain_ev = settled_explained_variance(pretrain) if pretrain else None
    reward = {r["step"]: r["rollout/reward/mean"] for r in train}
    step_s = [r["timing/step_s"] for r in train if "timing/step_s" in r]
    elapsed, total = {0: 0.0}, 0.0  # wall time of the PPO steps up to each step
    for r in train:
        total += r.get("timing/step_s", 0.0)
        elapsed[r["step"]] = total
    peaks = [r["memory/train_peak_gib"] for r in train if "memory/train_peak_gib" in r]
    cost = {  # what the run took: the median PPO step, the largest training-phase peak
        "step_s": statistics.median(step_s) if step_s else float("nan"),
        "train_peak_gib": max(peaks, default=float("nan")),
    }
    # multi-turn tasks: tool calls per trajectory of the training rollouts
    tools = {r["step"]: r["rollout/multi_turn/tool_calls/mean"] for r in train
             if "rollout/multi_turn/tool_calls/mean" in r}  # fmt: skip
    return {
        "reward": reward, "eval": evals, "teacher": teacher, "pretrain_ev": pretrain_ev,
        "tool_calls": tools,
        "cost": cost, "checkpoint_mib": checkpoint_mib(metrics_file.parent), "elapsed": elapsed,
    }  # fmt: skip


def checkpoint_mib(run_dir: Path) -> float:
    """MiB of the run's newest checkpoint (its roles' model and optimizer shards)."""
    steps = sorted((run_dir / "checkpoints").glob("step_*"))
    if not steps:
        return 0.0
    return sum(f.stat().st_size for f in steps[-1].rglob("*") if f.is_file()) / 2**20


def steps_to(curves: dict, bar: float | dict[int, float]) -> tuple[int, float] | None:
    """The first evaluated step whose held-out accuracy reaches `bar` (one number, or one per
    step: the teacher's at each evaluation), and the wall time of the PPO steps up to it
    (s); None if no evaluation did."""
    for step, acc in sorted(curves["eval"].items()):
        target = bar.get(step) if isinstance(bar, dict) else bar
        if target is not None and acc >= target:
            return step, curves["elapsed"].get(step, float("nan"))
    return None


def cost_table(arms: dict[str, dict[int, dict]], min_gain: float = MIN_GAIN) -> str:
    """Per recipe and seed: the held-out gain, the median step time, the training phase's
    peak memory (tracked tensors, `memory/train_peak_gib`), the last checkpoint's size, the
    step and wall time at which the accuracy first reached its start + `min_gain` ("-": never),
    and where some arm of the seed evaluated a teacher, the teacher's mean accuracy over its
    evaluations and the first step at which this arm's accuracy reached the teacher's at the
    same step (the same eval draws: a run's request seeds are its seed's and step's)."""
    teachers = {
        seed: c["teacher"] for curves in arms.values() for seed, c in curves.items() if c["teacher"]
    }
    lines = [
        "recipe                    seed   gain  step s  train peak GiB  checkpoint MiB"
        "  to +gain (step, s)" + ("  teacher  to teacher" if teachers else "")
    ]
    for name, curves in arms.items():
        for seed, c in curves.items():
            ev = c["eval"]
            hit = steps_to(c, ev[min(ev)] + min_gain)
            line = (
                f"{name:<24}  {seed:>4}  {ev[max(ev)] - ev[min(ev)]:+.2f}  "
                f"{c['cost']['step_s']:6.2f}  {c['cost']['train_peak_gib']:14.3f}  "
                f"{c['checkpoint_mib']:14.1f}  "
                + (f"{hit[0]:>7} {hit[1]:8.0f}" if hit else f"{'-':>7} {'-':>8}")
            )
            if seed in teachers:
                reached = steps_to(c, teachers[seed])
                mean = statistics.mean(teachers[seed].values())
                line += f"  {mean:7.4f}  {reached[0] if reached else '-':>10}"
            lines.append(line)
    return "\n".join(lines)


def weak_critics(curves: dict[int, dict], floor: float) -> list[int]:
    """The seeds whose value pretraining ended below `floor` explained variance (or at NaN)."""
    return [
        seed
        for seed, c in curves.items()
        if c["pretrain_ev"] is not None and not c["pretrain_ev"] >= floor
    ]


def plot_curves(curves: dict[int, dict], png: Path, title: str, accuracy: str) -> None:
    # why: optional (the `demo` extra) and slow to import: only the plot needs it
    import matplotlib

    matplotlib.use("Agg")
    # why: optional (the `demo` extra) and slow to import: only the plot needs it
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for seed, c in curves.items():
        (line,) = right.plot(list(c["eval"]), list(c["eval"].values()), "o-", label=f"seed {seed}")
        left.plot(list(c["reward"]), list(c["reward"].values()), color=line.get_color(),
                  label=f"seed {seed}")  # fmt: skip
    left.set_title("train reward mean (+1/-1, sampled at T=1)")
    right.set_title(f"held-out accuracy ({accuracy})")
    for ax, (lo, hi) in ((left, (-1.05, 1.05)), (right, (-0.02, 1.02))):
        ax.set_xlabel("PPO step (after value pretraining)")
        ax.set_ylim(lo, hi)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)


def gain_table(curves: dict[int, dict], min_gain: float) -> tuple[str, list[int]]:
    """A text table of before/after/gain per seed (and the critic's explained variance at the
    end of value pretraining), and the seeds below `min_gain`."""
    lines = ["seed  before  after  gain   pretrain EV  evals"]
    failing = []
    for seed, c in curves.items():
        ev = c["eval"]
        before, after = ev[min(ev)], ev[max(ev)]
        if after - before < min_gain:
            failing.append(seed)
        points = " ".join(f"{step}:{acc:.2f}" for step, acc in ev.items())
        critic_ev = "-" if c["pretrain_ev"] is None else f"{c['pretrain_ev']:.2f}"
        lines.append(
            f"{seed:>4}  {before:6.2f}  {after:5.2f}  {after - before:+.2f}  {critic_ev:>11}  {points}"
        )
    return "\n".join(lines), failing


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    p.add_argument("--smoke", action="store_true", help="only the stack check")
    p.add_argument("--n", type=int, default=4, help="samples per prompt (--smoke)")
    p.add_argument("--task", choices=sorted(TASKS), default="count_on")
    p.add_argument("--sft-steps", type=int, default=None, help="default: the task's")
    p.add_argument("--recipe", default=None, help="default: the task's VAPO recipe")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated RL seeds")
    p.add_argument(
        "--beside",
        help="another recipe run on the same warm start and seeds, alternating with --recipe; "
        "its gains, step times, peak memory and checkpoint sizes are printed beside",
    )
    p.add_argument(
        "--distill",
        action="append",
        default=[],
        help="an on-policy distillation recipe run on every seed after the recipe's, its "
        "teacher the recipe's first seed's last actor checkpoint (repeat for more)",
    )
    p.add_argument(
        "--min-gain", type=float, default=MIN_GAIN, help="held-out accuracy gain every seed needs"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=int(os.environ.get("OMP_NUM_THREADS", "1")),
        help="intra-op threads of every process (default: $OMP_NUM_THREADS, else 1)",
    )
    a = p.parse_args(argv)
    seeds = [int(s) for s in a.seeds.split(",")]
    pin_threads(a.threads)  # this process and every child: one less host difference

    t0 = time.time()
    task = TASKS[a.task]
    tools = task.chat_template != "chatml"
    model_dir = ensure_tiny_model(
        a.dir / ("tiny-qwen2" if not tools else f"tiny-qwen2-{task.chat_template}"),
        task.chat_template,
    )
    print(f"[1/5] tiny Qwen2 checkpoint: {model_dir}", flush=True)
    if a.smoke:
        return smoke(model_dir, a.n)
    recipe = a.recipe or task.recipe
    sft_dir = a.dir / f"tiny-sft-{a.task}"
    warm_start(model_dir, sft_dir, task, a.threads, a.sft_steps)
    print(f"[2/5] supervised warm start ({a.sft_steps or task.sft_steps} steps): {sft_dir}",
          flush=True)  # fmt: skip
    name = Path(recipe).stem
    arms = {name: recipe}
    for extra in (a.beside, *a.distill):
        if extra:
            arms[Path(extra).stem] = extra
    teacher = None  # the recipe's first seed's last actor checkpoint (--distill)
    results = {arm: {} for arm in arms}
    for seed in seeds:
        for arm, arm_recipe in arms.items():
            run_dir = a.dir / f"{arm}-seed{seed}"
            overrides = [f"teacher.path={teacher}"] if arm_recipe in a.distill else []
            run_rl(arm_recipe, sft_dir, run_dir, seed, overrides)
            results[arm][seed] = read_curves(run_dir / "metrics.jsonl")
            print(f"[3/5] {arm} seed {seed}: {run_dir} (metrics.jsonl, checkpoints/)", flush=True)
            if arm == name and teacher is None:
                latest = (run_dir / "checkpoints" / "latest").read_text().strip()
                teacher = run_dir / "checkpoints" / latest / "actor"
    curves = results[name]
    png = a.dir / "reward_curve.png"
    title = f"Tiny {name} on {task.title} (2 CPU ranks, TP=2), seeds {a.seeds}"
    plot_curves(curves, png, title, task.accuracy)
    print(f"[4/5] reward and accuracy curves: {png}", flush=True)
    table, failing = gain_table(curves, a.min_gain)
    print(f"[5/5] held-out accuracy ({task.accuracy}) per seed ({time.time() - t0:.0f} s in all, "
          f"{a.threads} thread(s) per process):\n{table}", flush=True)  # fmt: skip
    if len(arms) > 1:
        print(f"the arms side by side, in this run:\n{cost_table(results, a.min_gain)}",
              flush=True)  # fmt: skip
    for seed, c in curves.items():
        if c["tool_calls"]:
            steps = sorted(c["tool_calls"])
            first, last = c["tool_calls"][steps[0]], c["tool_calls"][steps[-1]]
            print(f"seed {seed}: tool calls per trajectory, step {steps[0]} {first:.2f} -> "
                  f"step {steps[-1]} {last:.2f}", flush=True)  # fmt: skip
    floor = load_config(recipe).critic.pretrain_ev_warn_below
    weak = weak_critics(curves, floor)
    if weak:  # the trainer warned too; the summary is where it is read
        print(f"warning: value pretraining ended below explained variance {floor} on seed(s) "
              f"{weak}: advantages lean on a critic that explains little", flush=True)  # fmt: skip
    for arm in list(arms)[1:]:
        failing += [f"{arm} {seed}" for seed in gain_table(results[arm], a.min_gain)[1]]
    if failing:
        raise SystemExit(
            f"the demo did not learn enough: seed(s) {failing} gained less than "
            f"{a.min_gain:+.2f} held-out accuracy"
        )
    print(f"every seed gained at least {a.min_gain:+.2f}", flush=True)


if __name__ == "__main__":
    main()
