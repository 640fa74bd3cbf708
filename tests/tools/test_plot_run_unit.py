"""tools/plot_run.py: the dashboard of a run, or of several, from metrics.jsonl."""

from __future__ import annotations

import json

import pytest

from tools.plot_run import main, read_run

PNG = b"\x89PNG\r\n\x1a\n"


def write_run(path, steps: int = 4, critic: bool = True):
    rows = []
    if critic:
        rows += [{"step": s, "stage": "value_pretrain", "critic/vf_explained_var": 0.1 * s,
                  "critic/vf_loss": 1.0 / s} for s in (1, 2)]  # fmt: skip
    rows.append({"step": 0, "stage": "eval", "eval/accuracy": 0.2})
    for s in range(1, steps + 1):
        row = {"step": s, "stage": "train", "rollout/reward/mean": -1 + 0.3 * s,
               "rollout/accuracy": 0.1 * s, "rollout/response_length/mean": 9.0 + s,
               "actor/entropy": 1.0 / s, "actor/reward_kl": 0.01 * s, "actor/pg_clipfrac": 0.02,
               "actor/grad_norm": 1.5, "perf/tokens_per_s": 900.0,
               "timing/generate_s": 0.1, "timing/train_s": 0.3, "timing/sync_s": 0.05}  # fmt: skip
        if critic:
            row["critic/vf_explained_var"] = None if s == 1 else 0.2  # NaN is logged as null
        if s % 2 == 0:
            row["eval/accuracy"] = 0.2 + 0.1 * s
        rows.append(row)
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_one_run_draws_every_panel_it_has_data_for(tmp_path, capsys):
    run = write_run(tmp_path / "vapo")
    main([str(run)])
    out = capsys.readouterr().out
    assert (run / "dashboard.png").read_bytes().startswith(PNG)
    for title in ("reward and accuracy", "response length", "entropy", "KL", "clip fraction",
                  "value pretraining", "explained variance", "grad norm", "throughput",
                  "time per phase"):  # fmt: skip
        assert title in out, out
    assert not list(run.glob(".*tmp*"))  # written to a temp file, then renamed


def test_compare_draws_runs_side_by_side_and_leaves_out_empty_panels(tmp_path, capsys):
    a, b = write_run(tmp_path / "grpo", critic=False), write_run(tmp_path / "rloo", critic=False)
    main(["--compare", str(a), str(b), "--out", str(tmp_path / "cmp.png")])
    out = capsys.readouterr().out
    assert (tmp_path / "cmp.png").read_bytes().startswith(PNG)
    assert "value pretraining" not in out and "explained variance" not in out


def test_a_bad_row_or_a_missing_file_is_named(tmp_path):
    run = write_run(tmp_path / "run")
    with open(run / "metrics.jsonl", "a") as f:
        f.write("{not json\n")
    with pytest.raises(SystemExit, match=r"metrics.jsonl line 8: not a metrics row"):
        read_run(run)
    with pytest.raises(SystemExit, match=r"nowhere/metrics.jsonl not found"):
        read_run(tmp_path / "nowhere")
