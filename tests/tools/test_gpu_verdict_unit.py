"""Unit tier: what `tools.gpu_verdict` reads from a GPU campaign's report: every bar pass,
FAIL or not measured, and the open choices a window decides."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tools import gpu_campaign, gpu_verdict
from tools.gpu_verdict import SHAPES, VARLEN_TEST, choices, criteria, verdict


def passed(*rows: dict) -> dict:
    return {"status": "passed", "results": list(rows), "finished": "2026-12-02T10:00:00"}


def train_step(speed: float, memory: float, plain: float, **more) -> dict:
    row = {
        "speed_ppo_over_peer": speed,
        "memory_ppo_over_peer": memory,
        "ratio_ppo_over_plain": plain,
        "planned_gib": 10.0,
        "ppo_update_peak_gib": 10.5,
        "ppo_update_tokens_per_s": 40000.0,
    }
    return passed({**row, **more})


def report(**parts) -> dict:
    env = {"devices": [{"name": "NVIDIA H200"}]}
    return {"date": "2026-12-02T10:00:00", "env": env, "parts": parts}


def log_of(outcome: str) -> str:
    return f"... short test summary info ...\n{outcome} tests/test_gpu.py::{VARLEN_TEST}\n"


def test_a_window_that_meets_every_bar_passes_each_and_decides_each_choice():
    good = {part: train_step(1.1, 0.8, 1.02) for part, _ in SHAPES}
    good["train_step_bf16"]["results"][0]["speed_kept_probs_over_logits_checkpointing"] = 1.07
    good["train_step_32k"]["results"][0]["speed_kept_probs_over_logits_checkpointing"] = 1.12
    good["train_step_16k"]["results"][0]["speed_compiled_head_forward_over_eager"] = 1.08
    r = report(
        **good,
        long_cot_peer=passed({"speedup_packed_over_peer": 2.9}),
        head_tile=passed({"speed_softmax_over_eager": 1.1}),
        gpu_tests={"status": "passed"},
    )
    checks = criteria(r)
    assert len(checks) == 4 * len(SHAPES) + 2
    assert all(c.ok is True for c in checks), [c.line() for c in checks if not c.ok]
    made = choices(r, log_of("PASSED"))
    assert made["kept_probs"].startswith("keeping the head's probabilities stays")
    assert made["head_sums"].startswith("default model.use_fused_kernels to on for CUDA")
    assert made["flash_varlen"] == "packed attention stays in the variable-length flash kernel"
    text = verdict(r, log_of("PASSED"))
    assert text.splitlines()[0] == "GPU campaign report on NVIDIA H200"
    assert "FAIL" not in text and "not measured" not in text
    # when each part read ran (profile_16k: only an older report's source of a choice)
    ran = [line.split(":")[0].strip() for line in text.splitlines()[1:] if line.startswith("  ")]
    assert ran == [*gpu_verdict.PARTS_READ, "profile_16k"]
    assert "  train_step_1b_4k: passed 2026-12-02T10:00:00" in text
    assert "  profile_16k: not run" in text


def test_the_compiled_heads_gain_comes_from_the_16k_bar_part_else_from_its_profile():
    def head_sums(**parts) -> str:
        return choices(report(**parts))["head_sums"]

    compiled = {"speed_compiled_head_forward_over_eager": 0.9}
    profiled = {"speed_compiled_head_forward_over_eager": 1.2}
    both = head_sums(train_step_16k=train_step(1, 1, 1, **compiled), profile_16k=passed(profiled))
    assert both == "compiled sums lost (0.9x); softmax_sums not measured"
    assert head_sums(profile_16k=passed(profiled)).startswith("default model.use_fused_kernels")
    # a 16k run without the compiled arm leaves the choice to the profile's figure
    assert head_sums(train_step_16k=train_step(1, 1, 1), profile_16k=passed(compiled)).startswith(
        "compiled sums lost (0.9x)"
    )
    assert head_sums(train_step_16k=train_step(1, 1, 1)) == "not measured"


def test_each_missed_bar_fails_by_name_and_the_choices_turn():
    r = report(
        train_step_bf16=train_step(
            0.64, 0.78, 1.38, speed_kept_probs_over_logits_checkpointing=0.97
        ),
        train_step_32k=train_step(0.8, 1.2, 1.02, ppo_update_peak_gib=5.0),  # plan 2x the peak
        profile_16k=passed({"speed_compiled_head_forward_over_eager": 0.93}),
        head_tile=passed({"speed_softmax_over_eager": 1.3}),
        long_cot_peer=passed({"speedup_packed_over_peer": 1.2}),
        gpu_tests={"status": "failed"},
    )
    failed = {c.what for c in criteria(r) if c.ok is False}
    assert failed == {
        "qwen2.5-0.5b, 4 x 2,048: PPO update / peer tokens/s",
        "qwen2.5-0.5b, 4 x 2,048: PPO update / plain forward-backward time",
        "qwen2.5-0.5b, 1 x 32,768: PPO update / peer tokens/s",
        "qwen2.5-0.5b, 1 x 32,768: PPO update / peer peak memory",
        "qwen2.5-0.5b, 1 x 32,768: planner / measured peak",
        "long-CoT batch: packed / peer padded to the longest, tokens/s",
    }
    made = choices(r, log_of("FAILED"))
    assert made["kept_probs"].startswith("set actor.logits_checkpointing to default true")
    assert made["head_sums"].startswith("take softmax_sums on CUDA")
    assert made["flash_varlen"].startswith("narrow flash_varlen_runs")
    r["parts"]["head_tile"]["results"][0]["speed_softmax_over_eager"] = 0.6
    assert choices(r)["head_sums"].startswith("the eager sums stay")


def test_a_compiled_form_that_ran_eager_decides_no_choice():
    """`tools.bench train_step` names the head's compiled functions that failed and ran eager
    (`compiled_fell_back`): the arms then timed no compiled kernel, so neither choice that
    compares them is made."""
    rows = {part: train_step(1.1, 0.8, 1.02) for part, _ in SHAPES}
    rows["train_step_bf16"]["results"][0].update(
        speed_kept_probs_over_logits_checkpointing=1.07,
        compiled_fell_back=["kept_probs_grad"],
    )
    rows["train_step_16k"]["results"][0].update(
        speed_compiled_head_forward_over_eager=1.08,
        ppo_update_compiled_head_forward_compiled_fell_back=["tile_sums"],
    )
    made = choices(report(**rows))
    assert made["kept_probs"] == "not measured: the compiled backward ran eager (kept_probs_grad)"
    assert made["head_sums"] == "not measured: compiled forms ran eager (tile_sums)"


def test_what_did_not_run_is_not_measured_never_a_pass():
    """A part missing, failed, or without the figure; the varlen test absent from the log."""
    r = report(
        train_step_bf16={"status": "failed", "results": [{"speed_ppo_over_peer": 2.0}]},
        train_step_32k={"status": "timeout", "results": []},
        gpu_tests={"status": "passed"},
    )
    assert {c.ok for c in criteria(r)} == {None}
    assert set(choices(r, "10 passed in 61.94s").values()) == {"not measured"}
    assert "pass " not in verdict(r)
    assert verdict({"parts": {}}).splitlines()[0] == "GPU campaign report on no CUDA device"


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        (
            {"planned_gib": 15.37, "ppo_update_peak_gib": 16.7095, "planned_over_measured": 0.5157},
            0.9198,
        ),
        ({"planned_over_measured": 0.94}, 0.94),
        ({}, None),
    ],
)
def test_the_plan_is_set_beside_the_updates_own_peak(row, expected):
    """Beside the update's peak measured alone where the row has it, not the alternating
    process's (every arm's model at once: 29.8 GiB where the update alone took 16.7)."""
    assert gpu_verdict.planner_ratio(row) == expected


@pytest.mark.parametrize(("body", "expected"), [("pass", "stays"), ("assert False", "narrow")])
def test_the_varlen_choice_reads_pytests_own_summary_line(tmp_path, body, expected):
    """The gpu_tests part's pytest flags (`tools.gpu_campaign`) on a test of that name."""
    (tmp_path / "test_gpu.py").write_text(f"def {VARLEN_TEST}():\n    {body}\n")
    (part,) = [p for p in gpu_campaign.parts(tmp_path) if p.name == "gpu_tests"]
    flags = [a for a in part.argv[1:] if a.startswith("-") and a != "-m"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *flags, "-p", "no:cacheprovider", "test_gpu.py"],
        cwd=tmp_path, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert expected in choices({}, done.stdout)["flash_varlen"], done.stdout
    # a run cut before its summary: the line -v wrote as the test ended
    cut = done.stdout.split("short test summary info")[0]
    assert expected in choices({}, cut)["flash_varlen"], cut


def test_the_command_reads_the_report_and_the_gpu_tests_log_beside_it(tmp_path, capsys):
    r = report(profile_16k=passed({"speed_compiled_head_forward_over_eager": 1.2}))
    (tmp_path / "report.json").write_text(json.dumps(r))
    (tmp_path / "gpu_tests.log").write_text(log_of("PASSED"))
    assert gpu_verdict.main([str(tmp_path / "report.json")]) == 0
    out = capsys.readouterr().out
    assert "choice flash_varlen: packed attention stays" in out
    assert "choice head_sums: default model.use_fused_kernels to on for CUDA" in out
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(SystemExit, match="bad.json: cannot read a campaign report"):
        gpu_verdict.main([str(tmp_path / "bad.json")])
