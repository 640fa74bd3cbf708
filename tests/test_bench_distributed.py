"""Distributed tier: the train-step benchmark runs end to end (its numbers are not asserted:
performance is measured by the benchmark itself, never by tests)."""

import json

import pytest

from megatron_rl.launch import run_torchrun

pytestmark = pytest.mark.distributed


def test_bench_train_step_writes_one_result_line(tmp_path):
    out = tmp_path / "results.jsonl"
    args = [
        "--preset",
        "tiny",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--seq-length",
        "32",
        "--tp",
        "2",
        "--out",
        str(out),
    ]
    run_torchrun("tools.bench_train_step", args, nproc=2)
    (line,) = out.read_text().splitlines()
    result = json.loads(line)
    assert result["layout"] == "TP2PP1DP1" and result["tokens_per_step"] == 4 * 32
    for key in ("ratio_ppo_over_plain", "plain_megatron_tokens_per_s", "ppo_update_tokens_per_s"):
        assert result[key] > 0
