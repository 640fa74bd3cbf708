"""Distributed tier: the fused core attention of the local spec (`models/attention.py`) equals
megatron-core's unfused `DotProductAttention` in logits and every parameter's gradient, with
grouped-query attention, at TP2 with sequence parallelism, PP2 and DP2 (2 ranks each); so do
packed micro-batches (rows of different lengths back to back, megatron's thd layout)."""

import pytest
import torch

from megatron_rl.launch import run_torchrun
from tests.tolerances import FP32_MODEL, assert_close
from tests.torchrun.core_attention import LAYOUTS

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("core_attention")
    run_torchrun("tests.torchrun.core_attention", ["--out-dir", str(out)])
    return {
        (layout, rank): torch.load(out / f"{layout}_{rank}.pt")
        for layout in LAYOUTS
        for rank in range(2)
    }


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("arm", ["sdpa", "sdpa_packed"])
def test_sdpa_and_packed_equal_unfused_attention(results, layout, rank, arm):
    r = results[layout, rank]
    logits, grads = r["logits"], r["grads"]
    assert len(logits[arm]) == len(logits["unfused"])
    for fused, reference in zip(logits[arm], logits["unfused"], strict=True):
        assert reference.abs().max() > 0.1  # not a degenerate comparison
        assert_close(fused, reference, FP32_MODEL, f"{layout} rank {rank} {arm} logits")
    assert sorted(grads[arm]) == sorted(grads["unfused"])
    for name, reference in grads["unfused"].items():
        assert_close(grads[arm][name], reference, FP32_MODEL, f"{layout} {rank} {arm} {name}")
    qkv = [n for n in grads["unfused"] if "linear_qkv.weight" in n]
    assert qkv and all(grads["unfused"][n].abs().max() > 0 for n in qkv)


def test_pp2_ran_the_logits_on_the_last_stage_only(results):
    assert results["pp2", 0]["logits"]["sdpa"] == []
    assert len(results["pp2", 1]["logits"]["sdpa"]) == 2
