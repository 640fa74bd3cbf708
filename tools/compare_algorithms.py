"""VAPO against the field on the demo's task: one warm start, one budget, several seeds.

    python -m tools.compare_algorithms [--task count_on|chains|sums]
        [--variants 'vapo,ppo,grpo,dapo,vapo + dynamic sampling,rloo,reinforce_pp']
        [--ablations] [--seeds 0,1,2]
        [--ablation-seeds SEEDS] [--dir runs/compare-TASK] [--out docs/compare_algorithms_TASK]

Every variant starts from the demo's warm start for the task (`examples.demo.tasks.TASKS`)
and gets the demo's budget (BUDGET: 20 steps of 16 prompts x 8 samples, actor lr 1e-4, one
PPO epoch in mini-batches of 64, TP=2, math reward +1/-1, held-out accuracy every 5 steps)
on the task's data, response budget and eval sets (task_overrides: `eval/accuracy` is avg@4
at T=1 for count_on and chains, greedy for sums); what makes each algorithm itself comes
from its recipe plus the overrides in VARIANTS (VAPO's recipe is the task's, for its alpha;
"vapo + dynamic sampling" adds DAPO's sampling, which VAPO's paper does not use). With
`--ablations`, VAPO is also run without each of its pieces (ABLATIONS, as in the paper's
Table 2). Writes OUT.md (a table: final accuracy mean +- std over seeds, the first eval step
at >= TARGET per seed, wall time per run) and OUT.png (mean held-out accuracy per variant).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from examples.demo.demo import ensure_tiny_model, read_curves, run_rl, warm_start
from examples.demo.tasks import TASKS
from megatron_rl.config import load_config, to_dict

TARGET = {"count_on": 0.6, "chains": 0.5, "sums": 0.6}
"""Held-out accuracy (`eval/accuracy`) for the "steps to reach" column, per task."""

BUDGET = [
    "parallel.tensor_model_parallel_size=2",
    "rollout.rollout_batch_size=16",
    "rollout.n_samples_per_prompt=8",
    "actor.optim.lr=1e-4",
    "actor.ppo_mini_batch_size=64",
    "actor.micro_batch_size=8",
    "actor.ppo_epochs=1",
    "critic.optim.lr=1e-3",
    "rewards.reward_fns=[{type: math, backend: fast, correct_reward: 1.0, incorrect_reward: -1.0, "
    "unparseable_reward: -1.0}]",
    "trainer.total_steps=20",
    "trainer.eval_interval=5",
    "trainer.deterministic=true",
]


def task_overrides(task: str) -> list[str]:
    """The task's data and response budget, read from its VAPO recipe (which VAPO variants
    run: its alpha suits the task's lengths)."""
    c = to_dict(load_config(TASKS[task].recipe))
    return [
        f"data.path={c['data']['path']}",
        "trainer.eval_data_path=null",  # a recipe's shorthand gives way to the sets
        f"trainer.eval_sets={json.dumps(c['trainer']['eval_sets'])}",  # YAML reads JSON
        f"rollout.max_new_tokens={c['rollout']['max_new_tokens']}",
    ]


DYNAMIC_SAMPLING = [
    # generate chunks of 16 prompts (at most 3) until 16 groups with unequal rewards are kept
    "rollout.rating.strategy=dynamic_filtering",
    "rollout.rating.chunk_size=16",
    "rollout.rating.max_num_gen_chunks=3",
]

VARIANTS: dict[str, tuple[str, list[str]]] = {
    # value pretraining, decoupled + length-adaptive GAE, clip-higher, token-level loss,
    # positive-sample NLL, group sampling (arXiv 2504.05118)
    "vapo": ("vapo", []),
    # PPO with plain GAE (lambda 0.95 for both), symmetric clip, KL in the reward
    "ppo": ("ppo", []),
    # group-normalised advantages, KL loss, every group kept (arXiv 2402.03300)
    "grpo": ("grpo", ["rollout.rating.strategy=plain"]),
    # clip-higher + dynamic sampling + token-level loss, no KL (arXiv 2503.14476)
    "dapo": (
        "grpo",
        [
            *DYNAMIC_SAMPLING,
            "actor.loss.clip_eps_high=0.28",
            "actor.loss.loss_agg_mode=token-mean",
            "actor.loss.kl_loss_coef=0.0",
        ],
    ),
    # not in VAPO's paper: DAPO's dynamic sampling added, to tell what DAPO's row owes to it
    "vapo + dynamic sampling": ("vapo", DYNAMIC_SAMPLING),
    "rloo": ("rloo", []),  # leave-one-out baseline (arXiv 2402.14740)
    "reinforce_pp": ("reinforce_pp", []),  # batch-whitened returns (arXiv 2501.03262)
}

ABLATIONS: dict[str, tuple[str, list[str]]] = {
    "vapo w/o value pretraining": ("vapo", ["critic.pretrain_steps=0"]),
    "vapo w/o decoupled GAE": ("vapo", ["algorithm.lambda_critic=0.95"]),
    "vapo w/o length-adaptive GAE": ("vapo", ["algorithm.length_adaptive_alpha=null"]),
    "vapo w/o positive NLL": ("vapo", ["actor.loss.nll_coef=0.0"]),
    "vapo w/o group sampling": (
        "vapo",
        ["rollout.rollout_batch_size=128", "rollout.n_samples_per_prompt=1"],
    ),
}


def variant_run(task: str, variant: str) -> tuple[str, list[str]]:
    """The recipe file and the overrides a variant (or ablation) runs with on a task."""
    recipe, overrides = {**VARIANTS, **ABLATIONS}[variant]
    path = TASKS[task].recipe if recipe == "vapo" else f"examples/tiny/{recipe}.yaml"
    return path, [*BUDGET, *task_overrides(task), *overrides]


def summarise(name: str, runs: dict[int, dict], seconds: dict[int, float], target: float) -> dict:
    """One table row from the per-seed `read_curves` results and wall times."""
    final = [c["eval"][max(c["eval"])] for c in runs.values()]
    reach = {
        seed: next((step for step, acc in sorted(c["eval"].items()) if acc >= target), None)
        for seed, c in runs.items()
    }
    return {
        "variant": name,
        "seeds": list(runs),
        "start": statistics.mean(c["eval"][min(c["eval"])] for c in runs.values()),
        "final_mean": statistics.mean(final),
        "final_std": statistics.stdev(final) if len(final) > 1 else 0.0,
        "final": final,
        "steps_to_target": reach,
        "seconds_per_run": statistics.mean(seconds.values()),
        "target": target,
    }


def markdown_table(rows: list[dict]) -> str:
    lines = [
        f"| variant | seeds | accuracy before | final accuracy, mean +- std | per seed "
        f"| first eval step at >= {rows[0]['target']} | wall time per run |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        per_seed = " / ".join(f"{a:.2f}" for a in r["final"])
        reach = " / ".join("never" if s is None else str(s) for s in r["steps_to_target"].values())
        lines.append(
            f"| {r['variant']} | {','.join(map(str, r['seeds']))} | {r['start']:.2f} "
            f"| {r['final_mean']:.2f} +- {r['final_std']:.2f} | {per_seed} | {reach} "
            f"| {r['seconds_per_run']:.0f} s |"
        )
    return "\n".join(lines)


def plot(curves: dict[str, dict[int, dict]], png: Path, accuracy: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for name, runs in curves.items():
        steps = sorted(set.intersection(*(set(c["eval"]) for c in runs.values())))
        mean = [statistics.mean(c["eval"][s] for c in runs.values()) for s in steps]
        style = "--" if name.startswith("vapo w/o") else "o-"
        ax.plot(steps, mean, style, label=f"{name} ({len(runs)} seed{'s' * (len(runs) > 1)})")
    ax.set_xlabel("RL step")
    ax.set_ylabel(f"held-out accuracy, {accuracy} (mean over seeds)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", choices=sorted(TASKS), default="count_on")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--ablations", action="store_true", help="also VAPO without each piece")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--ablation-seeds", default=None, help="default: --seeds")
    p.add_argument("--dir", type=Path, default=None, help="default: runs/compare-TASK")
    p.add_argument("--out", type=Path, default=None, help="default: docs/compare_algorithms_TASK")
    a = p.parse_args(argv)
    unknown = [v for v in a.variants.split(",") if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")

    task = TASKS[a.task]
    run_dir = a.dir or Path(f"runs/compare-{a.task}")
    out_base = a.out or Path(f"docs/compare_algorithms_{a.task}")
    model = ensure_tiny_model(run_dir / "tiny-qwen2")
    sft = run_dir / "tiny-sft"
    warm_start(model, sft, task, threads=1)

    plan = [(v, a.seeds) for v in a.variants.split(",")]
    if a.ablations:
        plan += [(name, a.ablation_seeds or a.seeds) for name in ABLATIONS]
    curves, rows = {}, []
    for name, seeds in plan:
        recipe, overrides = variant_run(a.task, name)
        runs, seconds = {}, {}
        for seed in (int(s) for s in seeds.split(",")):
            out = run_dir / f"{name.replace(' ', '_').replace('/', '')}-seed{seed}"
            t0 = time.time()
            run_rl(recipe, sft, out, seed, overrides, False)
            seconds[seed] = time.time() - t0
            runs[seed] = read_curves(out / "metrics.jsonl")
            evals = " ".join(f"{k}:{v:.2f}" for k, v in runs[seed]["eval"].items())
            print(f"{name} seed {seed}: {evals} ({seconds[seed]:.0f} s)", flush=True)
        curves[name] = runs
        rows.append(summarise(name, runs, seconds, TARGET[a.task]))
    table = markdown_table(rows)
    out_base.parent.mkdir(parents=True, exist_ok=True)
    out_base.with_suffix(".md").write_text(table + "\n")
    plot(curves, out_base.with_suffix(".png"), task.accuracy)
    print(table)


if __name__ == "__main__":
    main()
