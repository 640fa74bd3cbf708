"""Distributed tier: a training checkpoint resumes at another parallel layout and leaves the
system as a Hugging Face model.

An actor and a critic at TP2 take an update (Adam moments now non-zero), are saved as the
trainer saves them, and take a second update; the save loaded at TP1 DP2 and TP1 PP2 takes
that second update with the losses, log-probs and weights of the
uninterrupted run. Exporting the save gives transformers models with exactly the saved
weights, and vLLM serves the actor greedily as transformers does."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from checkpoints_convert.megatron_to_hf import main as megatron_to_hf
from megatron_rl.launch import run_torchrun
from megatron_rl.models.hf_mapping import HFCheckpointReader
from tests.tolerances import FP32_MODEL, assert_close

pytestmark = pytest.mark.distributed

LAYOUTS = {"tp1_dp2": (1, 1), "tp1_pp2": (1, 2)}
"""(TP, PP) of 2 ranks; the save is TP2. The same layout: tests/trainer/test_train_distributed."""
COMPARED = ("pg_loss", "nll_loss", "entropy", "ppo_kl", "pg_clipfrac", "grad_norm")


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    ckpt = root / "step_000001"

    def run(name, tp, pp, *load):
        args = ["--hf-dir", str(tiny_model_dir), "--ckpt", str(ckpt), "--out", str(root / name)]
        run_torchrun("tests.torchrun.reshard", [*args, "--tp", str(tp), "--pp", str(pp), *load])
        return torch.load(root / name, weights_only=False)

    out = {"uninterrupted": run("uninterrupted", 2, 1)}
    out.update({name: run(name, tp, pp, "--load") for name, (tp, pp) in LAYOUTS.items()})
    out["model_only"] = run("model_only", 2, 1, "--model-only")
    return ckpt, out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_resume_at_another_layout_takes_the_uninterrupted_step(runs, layout):
    _, out = runs
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
    assert_close(
        got["metrics"]["critic"]["value_loss"], ref["metrics"]["critic"]["value_loss"], tol
    )
    assert_close(got["logprobs"], ref["logprobs"], tol, "log-probs")
    for role in ("actor", "critic"):
        for name, tensor in ref["after"][role].items():
            assert_close(got["after"][role][name], tensor, tol, f"{role} {name}")


def test_without_the_adam_state_the_step_differs(runs):
    """The same weights with fresh optimizer state take another step: the test above would
    fail if the moments were not saved or not loaded."""
    _, out = runs
    ref, fresh = out["uninterrupted"]["after"]["actor"], out["model_only"]["after"]["actor"]
    assert max((fresh[k] - ref[k]).abs().max().item() for k in ref) > 1e-4


@pytest.fixture(scope="module")
def exported(runs, tmp_path_factory):
    ckpt, out = runs
    root = tmp_path_factory.mktemp("exported")
    megatron_to_hf(["--ckpt-dir", str(ckpt), "--role", "actor", "--out-dir", str(root / "actor")])
    megatron_to_hf(
        [
            "--ckpt-dir",
            str(ckpt),
            "--role",
            "critic",
            "--out-dir",
            str(root / "critic"),
            "--pp",
            "2",
        ]
    )
    return root, out["uninterrupted"]["saved"]


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_export_writes_the_saved_weights_as_a_transformers_model(exported, role):
    root, saved = exported
    reader = HFCheckpointReader(root / role)
    assert sorted(reader.keys()) == sorted(saved[role])
    for name in reader.keys():
        assert torch.equal(reader(name), saved[role][name]), name
    auto = AutoModelForCausalLM if role == "actor" else AutoModelForSequenceClassification
    model = auto.from_pretrained(root / role, dtype=torch.float32)
    state = model.state_dict()
    name = "score.weight" if role == "critic" else "lm_head.weight"
    assert torch.equal(state[name], saved[role][name])
    assert (root / role / "tokenizer.json").exists()


@pytest.mark.vllm
def test_vllm_serves_the_exported_actor_as_transformers_computes_it(exported, tmp_path):
    root, _ = exported
    cmd = [sys.executable, "-m", "tests.torchrun.vllm_greedy", str(tmp_path), str(root / "actor")]
    subprocess.run(cmd, check=True, capture_output=True, timeout=900)
    model = AutoModelForCausalLM.from_pretrained(root / "actor", dtype=torch.float32)
    for prompt, response in json.loads((tmp_path / "actor.json").read_text()):
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1]
        chosen = logits.gather(-1, torch.tensor(response)[:, None])[:, 0]
        assert (logits.max(-1).values - chosen).max() <= 1e-4
