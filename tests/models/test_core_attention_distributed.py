"""Distributed tier: the fused core attention of the local spec (`models/attention.py`) equals
megatron-core's unfused `DotProductAttention` in logits and every parameter's gradient, with
grouped-query attention, at TP2 with sequence parallelism, PP2 and DP2 (2 ranks each); so do
packed micro-batches (rows of different lengths back to back, megatron's thd layout). Our
decoder layer's forward (`models/layer.py`) gives megatron-core's own logits and gradients
to the bit in each of these, and in eval mode without gradients."""

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


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("arm", ["sdpa", "sdpa_packed", "sdpa_eval"])
def test_our_layer_forward_equals_megatrons_to_the_bit(results, layout, rank, arm):
    r = results[layout, rank]
    assert r["lean_layers"] and all(r["lean_layers"])  # every layer took our forward
    ours, megatrons = r["logits"][arm], r["logits"][f"{arm}_megatron_layer"]
    assert len(ours) == len(megatrons) == (0 if (layout, rank) == ("pp2", 0) else 2)
    for a, b in zip(ours, megatrons, strict=True):
        assert b.abs().max() > 0.1  # not a degenerate comparison
        assert torch.equal(a, b), f"{layout} rank {rank} {arm} logits"
    if arm == "sdpa_eval":
        return
    grads, reference = r["grads"][arm], r["grads"][f"{arm}_megatron_layer"]
    assert sorted(grads) == sorted(reference)
    for name, g in reference.items():
        assert torch.equal(grads[name], g), f"{layout} rank {rank} {arm} {name}"
    layers = [g for name, g in reference.items() if ".layers." in name]
    assert layers and all(g.abs().max() > 0 for g in layers)  # every layer's weights trained
