"""The curves users look at first, from a run's metrics.jsonl, in one image.

    python -m tools.plot_run RUN_DIR [--out RUN_DIR/dashboard.png]
    python -m tools.plot_run --compare RUN_A RUN_B ... --out compare.png

Panels (a panel whose metrics no run logged is left out): reward and accuracy (held-out
accuracy as points), response length, entropy, KL, clip fraction, value pretraining
(explained variance and value loss per pretraining step), the critic's explained variance,
grad norm, throughput, and time per phase (stacked, first run). With --compare each run has
one colour, named by its directory.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PHASES = ("generate_s", "score_s", "experience_s", "train_s", "sync_s")
PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    # (title, stage, [(metric, line style)])
    ("reward and accuracy", "train", [("rollout/reward/mean", "-"), ("rollout/accuracy", "--"),
                                      ("eval/accuracy", "o")]),
    ("response length", "train", [("rollout/response_length/mean", "-"),
                                  ("rollout/response_length/max", "--")]),
    ("entropy", "train", [("actor/entropy", "-")]),
    ("KL", "train", [("actor/reward_kl", "-"), ("actor/ppo_kl", "--"), ("actor/kl_loss", ":")]),
    ("clip fraction", "train", [("actor/pg_clipfrac", "-"), ("critic/vf_clipfrac", "--")]),
    ("value pretraining", "value_pretrain", [("critic/vf_explained_var", "-"),
                                             ("critic/vf_loss", "--")]),
    ("explained variance", "train", [("critic/vf_explained_var", "-")]),
    ("grad norm", "train", [("actor/grad_norm", "-"), ("critic/grad_norm", "--")]),
    ("throughput (tokens/s)", "train", [("perf/tokens_per_s", "-")]),
]  # fmt: skip


def read_run(run: Path) -> dict[str, list[dict]]:
    """{stage: rows} of RUN/metrics.jsonl; a missing or unreadable file names itself."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"plot_run: {path} not found (a run's output_dir holds it)")
    rows: dict[str, list[dict]] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            rows.setdefault(row["stage"], []).append(row)
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise SystemExit(f"plot_run: {path} line {number}: not a metrics row ({e})") from None
    return rows


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) where `key` was logged as a number (null, i.e. NaN, left out)."""
    points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [s for s, _ in points], [v for _, v in points]


def panels_with_data(runs: dict[str, dict[str, list[dict]]]) -> list:
    kept = [
        p for p in PANELS
        if any(series(stages.get(p[1], []), key)[0] for stages in runs.values() for key, _ in p[2])
    ]  # fmt: skip
    first = next(iter(runs.values()))
    if any(series(first.get("train", []), f"timing/{ph}")[0] for ph in PHASES):
        kept.append(("time per phase (s)", "phases", []))
    return kept


def plot(runs: dict[str, dict[str, list[dict]]], out: Path) -> list[str]:
    """Draw `runs` ({name: stages}) into `out`; returns the panel titles drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = panels_with_data(runs)
    if not panels:
        raise SystemExit("plot_run: no metric to plot in " + ", ".join(runs))
    cols = 3
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.4 * rows), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, stage, keys) in zip(axes.flat, panels, strict=False):
        ax.set_title(title)
        ax.set_xlabel("value-pretraining step" if stage == "value_pretrain" else "step")
        if stage == "phases":
            name, stages = next(iter(runs.items()))
            train = stages.get("train", [])
            stacked: dict[int, float] = {}  # step -> seconds drawn so far
            for phase in PHASES:
                steps, values = series(train, f"timing/{phase}")
                if steps:
                    bottom = [stacked.get(s, 0.0) for s in steps]
                    ax.bar(steps, values, bottom=bottom, label=phase.removesuffix("_s"))
                    for s, v in zip(steps, values, strict=True):
                        stacked[s] = stacked.get(s, 0.0) + v
            ax.legend(fontsize=7, title=name, title_fontsize=7)
            continue
        for index, (name, stages) in enumerate(runs.items()):
            rows_ = stages.get(stage, [])
            if stage == "train" and keys[-1][0] == "eval/accuracy":  # the step-0 evaluation
                rows_ = stages.get("eval", []) + rows_
            for key, style in keys:
                steps, values = series(rows_, key)
                if not steps:
                    continue
                label = key if len(runs) == 1 else f"{name}: {key}"
                ax.plot(steps, values, style, color=colours[index % len(colours)], label=label)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(" vs ".join(runs))
    fig.tight_layout(rect=(0, 0, 1, 0.97))  # room for the title
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.stem}.tmp{out.suffix}")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    tmp.replace(out)
    return [p[0] for p in panels]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", nargs="?", type=Path, help="a run's output_dir")
    p.add_argument("--compare", nargs="+", type=Path, metavar="RUN", help="several runs")
    p.add_argument("--out", type=Path, help="the image (default: RUN/dashboard.png)")
    a = p.parse_args(argv)
    dirs = a.compare or ([a.run] if a.run else [])
    if not dirs or (a.compare and a.run):
        p.error("give one RUN_DIR, or --compare RUN_A RUN_B ...")
    if a.compare and a.out is None:
        p.error("--compare needs --out")
    out = a.out or dirs[0] / "dashboard.png"
    runs = {d.name if d.name else str(d): read_run(d) for d in dirs}
    if len(runs) != len(dirs):
        runs = {str(d): read_run(d) for d in dirs}  # two runs with one directory name
    drawn = plot(runs, out)
    print(f"wrote {out}: {', '.join(drawn)}")


if __name__ == "__main__":
    main()
