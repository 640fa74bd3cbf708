"""Distributed tier: a training checkpoint resumes at another parallel layout.

An actor and a critic at TP2 take an update (Adam moments now non-zero), are saved as the
trainer saves them, and take a second update; the save loaded at TP1 DP2 and TP1 PP2 takes
that second update with the losses, log-probs and weights of the uninterrupted run. The same through the trainer's own commands, with the export to
transformers and vLLM: tests/trainer/test_journey_distributed.py."""

import pytest
import torch

from megatron_rl.launch import run_torchrun
from tests.tolerances import FP32_MODEL, assert_close

# the journeys' tier (~1.5 min: two runs at two layouts), to keep `make test` under 20 minutes
pytestmark = [pytest.mark.distributed, pytest.mark.e2e]

LAYOUTS = {"tp1_dp2": (1, 1), "tp1_pp2": (1, 2)}
"""(TP, PP) of 2 ranks; the save is TP2. The same layout: tests/trainer/test_train_distributed."""
COMPARED = ("pg_loss", "nll_loss", "entropy", "ppo_kl", "pg_clipfrac", "grad_norm")


MOE_LAYOUTS = {
    "ep1_dp2": ("--ep", "1"),
    "tp2_sp_ep2_etp1": ("--tp", "2", "--ep", "2", "--etp", "1"),
}
"""Where the mixture of experts saved at EP2 (TP1, DP2) resumes."""


def reshard_runs(hf_dir, root, saved_at, layouts):
    ckpt = root / "step_000001"

    def run(name, *layout):
        args = ["--hf-dir", str(hf_dir), "--ckpt", str(ckpt), "--out", str(root / name)]
        run_torchrun("tests.torchrun.reshard", [*args, *layout])
        return torch.load(root / name, weights_only=False)

    out = {"uninterrupted": run("uninterrupted", *saved_at)}
    out.update({name: run(name, *layout, "--load") for name, layout in layouts.items()})
    return ckpt, out


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    layouts = {name: ("--tp", str(tp), "--pp", str(pp)) for name, (tp, pp) in LAYOUTS.items()}
    return reshard_runs(tiny_model_dir, tmp_path_factory.mktemp("reshard"), ("--tp", "2"), layouts)


@pytest.fixture(scope="module")
def moe_runs(family_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard_moe")
    return reshard_runs(family_dir("qwen3-moe"), root, ("--ep", "2"), MOE_LAYOUTS)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_resume_at_another_layout_takes_the_uninterrupted_step(runs, layout):
    assert_resumed_exactly(runs[1], layout)


@pytest.mark.parametrize("layout", MOE_LAYOUTS)
def test_a_mixture_of_experts_saved_at_ep2_resumes_at_another_expert_layout(moe_runs, layout):
    """Experts and their Adam moments (megatron's chained expert optimizer) saved over two EP
    ranks load whole on each rank (EP1) or with the dense part split over TP2+SP."""
    assert_resumed_exactly(moe_runs[1], layout)


def assert_resumed_exactly(out, layout):
    ref, got = out["uninterrupted"], out[layout]
    for role in ("actor", "critic"):  # the weights load exactly, whatever the layout
        for name, tensor in ref["saved"][role].items():
            assert torch.equal(got["saved"][role][name], tensor), f"{role} {name}"
    # The next update: same losses, log-probs and weights, up to the order of TP reductions.
    # Adam divides by sqrt(v) + eps, so wrong or missing moments would move the weights by
    # up to lr = 1e-3, far beyond this tolerance (test below).
    tol = FP32_MODEL
    for key in COMPARED:
        assert_close(got["metrics"]["actor"][key], ref["metrics"]["actor"][key], tol, key)
    assert_close(got["metrics"]["critic"]["vf_loss"], ref["metrics"]["critic"]["vf_loss"], tol)
    assert_close(got["logprobs"], ref["logprobs"], tol, "log-probs")
    for role in ("actor", "critic"):
        for name, tensor in ref["after"][role].items():
            assert_close(got["after"][role][name], tensor, tol, f"{role} {name}")


def test_without_the_adam_state_the_step_differs(runs):
    """The same weights with fresh optimizer state take another step: the test above would
    fail if the moments were not saved or not loaded."""
    _, out = runs
    ref, fresh = out["uninterrupted"]["after"]["actor"], out["uninterrupted"]["model_only_after"]
    assert max((fresh[k] - ref[k]).abs().max().item() for k in ref) > 1e-4
