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
    with pytest.raises(RuntimeError, match="call megatron_rl.platform.initialize first"):
        cfg.build()
    with pytest.raises(ValueError, match="backend 'megatron' runs inside the torchrun world"):
        make_scoring_pool([cfg], ScoringPoolConfig(num_workers=1))
    with pytest.raises(ValueError, match="backend 'vllm'"):
        RewardModelConfig(model_dir="x", backend="vllm")
