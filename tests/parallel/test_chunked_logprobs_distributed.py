"""Distributed tier: log-probs and entropy made tile by tile from hidden states never hold
the [tokens, V/tp] logits, and equal those of the full vocab-parallel logits in value and in
both gradients (hidden states, projection) at TP2 and TP1."""

import pytest
import torch

from megatron_rl.launch import run_torchrun
from tests.tolerances import FP32_MODEL, assert_close
from tests.torchrun.chunked_logprobs import CASES, LAYOUTS

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("chunked_logprobs")
    run_torchrun("tests.torchrun.chunked_logprobs", ["--out-dir", str(out)])
    return {
        (layout, rank): torch.load(out / f"{layout}_{rank}.pt")
        for layout in LAYOUTS
        for rank in range(2)
    }


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("case", list(CASES))
def test_chunked_equals_full_logits(results, layout, rank, case):
    chunked, full = results[layout, rank][case]["chunked"], results[layout, rank][case]["full"]
    keys = ["logprobs", "entropy", "grad_hidden", "grad_weight"]
    if CASES[case][2] == "not_calculated":
        assert chunked.pop("entropy") is None
        keys.remove("entropy")
    for key in keys:
        assert full[key].abs().max() > 1e-3, key  # a real comparison
        assert_close(chunked[key], full[key], FP32_MODEL, f"{layout} rank {rank} {case} {key}")


def test_tp2_ranks_hold_different_vocabulary_slices(results):
    """At TP2 each rank's projection gradient is its own slice's (not a copy of one)."""
    a = results["tp2", 0]["one_token_tiles"]["chunked"]["grad_weight"]
    b = results["tp2", 1]["one_token_tiles"]["chunked"]["grad_weight"]
    assert a.shape == b.shape and not torch.allclose(a, b)
    # the two ranks agree on the tokens' log-probs: the softmax is over the whole vocabulary
    assert_close(
        results["tp2", 0]["one_token_tiles"]["chunked"]["logprobs"],
        results["tp2", 1]["one_token_tiles"]["chunked"]["logprobs"],
        FP32_MODEL,
    )
