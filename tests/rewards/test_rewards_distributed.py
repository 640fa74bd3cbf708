"""A reward model sharded by Megatron (TP=2, torchrun/gloo) scores like the HF one."""

from __future__ import annotations

import json

import pytest

from megatron_rl.launch import run_torchrun
from megatron_rl.rewards import RewardModelConfig, ScoringPoolConfig, make_scoring_pool
from tests.tolerances import FP32_MODEL, assert_close

pytestmark = pytest.mark.distributed


def test_megatron_reward_model_matches_hf(llama_rm_dir, tmp_path):
    from tests.torchrun.megatron_rm import inputs

    out = tmp_path / "scores.json"
    run_torchrun(
        "tests.torchrun.megatron_rm", ["--rm-dir", str(llama_rm_dir), "--out", str(out)], nproc=2
    )
    got = json.loads(out.read_text())
    assert got["errors"] == {"reward_model": [None] * 6}
    expected = RewardModelConfig(model_dir=str(llama_rm_dir)).build().score_batch(inputs())
    assert len(set(expected)) == 6  # six different conversations, six different scores
    assert_close(got["rewards"], expected, FP32_MODEL)


def test_megatron_backend_needs_the_torchrun_world_and_no_ray(llama_rm_dir):
    cfg = RewardModelConfig(model_dir=str(llama_rm_dir), backend="megatron")
    with pytest.raises(RuntimeError, match="call megatron_rl.distributed.initialize first"):
        cfg.build()
    with pytest.raises(ValueError, match="backend 'megatron' runs inside the torchrun world"):
        make_scoring_pool([cfg], ScoringPoolConfig(num_workers=1))
    with pytest.raises(ValueError, match="backend 'vllm'"):
        RewardModelConfig(model_dir="x", backend="vllm")


def test_tensor_parallel_ranks_share_one_scoring(tmp_path):
    """A reward that differs per rank (a sampling judge) gives every TP rank the same scores,
    and each sample is scored once, on one rank (a remote RM is called once, not TP times)."""
    calls = tmp_path / "calls.txt"
    run_torchrun(
        "tests.torchrun.reward_scoring",
        ["--out-dir", str(tmp_path), "--calls-file", str(calls)],
        nproc=2,
    )
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert len(rank0) == 6 and rank0 == rank1
    assert all(0.0 <= r < 1.0 for r in rank0)  # rank 0's scores
    assert calls.read_text().split() == ["0"] * 6
