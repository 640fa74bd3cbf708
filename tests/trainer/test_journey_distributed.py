"""The journey of a user's model through the system, each command run as a user runs it:

HF model --hf_to_megatron (TP2)--> Megatron checkpoint
  --megatron_rl.cli.train at TP2, started from that checkpoint (no HF weights read)-->
  value pretraining, PPO steps, the actor in HF format after each step; SIGTERM to every
  process (SLURM's scancel) -> a complete checkpoint, exit 0
  --megatron_rl.cli.train at TP1 DP2--> resumes (weights, Adam moments, step, data position)
  and finishes
  --megatron_to_hf --role actor|critic--> Hugging Face models
  -> transformers loads both; vLLM serves the actor greedily as transformers computes it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from megatron_rl.models.hf_mapping import HFCheckpointReader
from tests.checkpoints import role_tensors, same_weights
from tests.trainer.runs import (
    LABEL_REWARD,
    SMALL_VAPO,
    finite,
    metrics,
    train,
    train_until_sigterm,
    write_labelled_prompts,
)

pytestmark = [pytest.mark.distributed, pytest.mark.e2e]

TOTAL_STEPS = 4


def command(module: str, *args: str) -> str:
    cmd = [sys.executable, "-m", module, *args]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{cmd}:\n{result.stdout}\n{result.stderr[-4000:]}"
    return result.stdout


@pytest.fixture(scope="module")
def journey(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("journey")
    converted, run = root / "megatron", root / "run"
    prompts = write_labelled_prompts(root / "prompts.jsonl")
    command(
        "checkpoints_convert.hf_to_megatron", "--hf-dir", str(tiny_model_dir),
        "--out-dir", str(converted), "--tp", "2",
    )  # fmt: skip
    overrides = [
        *SMALL_VAPO,
        f"model.path={converted}",
        f"data.path={prompts}",
        LABEL_REWARD,
        "critic.pretrain_steps=2",
        "critic.optim.lr=1e-3",
        f"trainer.total_steps={TOTAL_STEPS}",
        "trainer.save_interval=0",  # the SIGTERM save is the only one before the end
        "trainer.save_hf_interval=1",
    ]
    first = train_until_sigterm("vapo", run, *overrides, after_steps=1)
    second = train("vapo", run, *overrides, "parallel.tensor_model_parallel_size=1").output
    for role, pp in (("actor", "1"), ("critic", "2")):  # the critic loaded at PP2
        command(
            "checkpoints_convert.megatron_to_hf", "--ckpt-dir", str(run), "--role", role,
            "--out-dir", str(root / "export" / role), "--pp", pp,
        )  # fmt: skip
    return root, run, first, second


def test_the_run_starts_from_the_converted_checkpoint(journey):
    _, run, first, _ = journey
    records = metrics(run)
    # vLLM started from random weights (a Megatron checkpoint has no HF ones) and took the
    # actor's before the first rollout: its log-probs are the trainer's from step 1 on.
    assert records[0]["rollout/logprob_gap/max"] < 1e-4, records[0]
    assert len(metrics(run, "value_pretrain")) == 2
    assert "saved Hugging Face model" in first


def test_sigterm_saves_a_complete_checkpoint_and_the_resume_at_another_layout_continues(journey):
    _, run, first, second = journey
    root = run / "checkpoints"
    steps = sorted(p.name for p in root.iterdir() if p.name.startswith("step_"))
    interrupted = root / steps[0]
    state = json.loads((interrupted / "trainer_state.json").read_text())
    assert 1 <= state["step"] < TOTAL_STEPS, state  # the SIGTERM save, mid-run
    assert f"saved checkpoint {interrupted}" in first
    # (and what the aborted step's rollout had generated, when the signal landed in a step:
    # at this other layout, 2 rollout replicas for 1, it is said and generated anew)
    assert sorted(p.name for p in interrupted.iterdir() if p.name != "rollout_progress") == [
        "actor", "config.yaml", "critic", "rng", "trainer_state.json",
    ]  # fmt: skip
    if (interrupted / "rollout_progress").exists():
        assert "was saved by 1 rollout replicas, this run has 2" in second
    assert not [p for p in root.iterdir() if p.name.endswith(".tmp")]
    assert f"resumed from {interrupted} (step {state['step']})" in second
    records = metrics(run)
    assert [r["step"] for r in records] == list(range(1, TOTAL_STEPS + 1))
    assert all(finite(r) for r in records) and records[-1]["rollout/logprob_gap/max"] < 1e-4
    final = root / (root / "latest").read_text()
    assert json.loads((final / "trainer_state.json").read_text())["step"] == TOTAL_STEPS
    saved_layout = json.loads((final / "actor" / "megatron_rl.json").read_text())["saved_layout"]
    assert saved_layout["tensor_model_parallel_size"] == 1
    assert not same_weights(role_tensors(interrupted, "actor"), role_tensors(final, "actor"))


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_the_export_is_the_final_checkpoint_as_a_transformers_model(journey, role):
    root, run, *_ = journey
    ckpt = run / "checkpoints" / (run / "checkpoints" / "latest").read_text()
    saved = role_tensors(ckpt, role)
    exported = HFCheckpointReader(root / "export" / role)
    auto = AutoModelForCausalLM if role == "actor" else AutoModelForSequenceClassification
    model = auto.from_pretrained(root / "export" / role, dtype=torch.float32)
    head = "lm_head.weight" if role == "actor" else "score.weight"
    saved_head = "output_layer.weight"
    vocab = model.config.vocab_size  # the checkpoint's projection carries vocabulary padding
    assert torch.equal(model.state_dict()[head], saved[saved_head][:vocab])
    assert torch.equal(exported(head), saved[saved_head][:vocab])
    assert (root / "export" / role / "tokenizer.json").exists()


def test_the_trainers_hf_exports_equal_the_converted_checkpoint(journey):
    """trainer.save_hf_interval wrote the actor after every step, at TP2 before the SIGTERM
    and at TP1 DP2 after; the last equals megatron_to_hf's export of the final checkpoint."""
    root, run, *_ = journey
    written = sorted(p.name for p in (run / "hf").iterdir())
    assert written[-1] == f"step_{TOTAL_STEPS:06d}" and len(written) >= 2, written
    ours, theirs = (
        HFCheckpointReader(run / "hf" / written[-1]),
        HFCheckpointReader(root / "export" / "actor"),
    )
    assert sorted(ours.keys()) == sorted(theirs.keys())
    for name in ours.keys():
        assert torch.equal(ours(name), theirs(name)), name
    first, last = HFCheckpointReader(run / "hf" / written[0]), ours
    assert not torch.equal(first("lm_head.weight"), last("lm_head.weight"))


@pytest.mark.vllm
def test_vllm_serves_the_exported_actor_as_transformers_computes_it(journey, tmp_path):
    root, *_ = journey
    actor = root / "export" / "actor"
    cmd = [sys.executable, "-m", "tests.torchrun.vllm_greedy", str(tmp_path), str(actor)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=900)
    model = AutoModelForCausalLM.from_pretrained(actor, dtype=torch.float32)
    for prompt, response in json.loads((tmp_path / "actor.json").read_text()):
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1]
        chosen = logits.gather(-1, torch.tensor(response)[:, None])[:, 0]
        assert (logits.max(-1).values - chosen).max() <= 1e-4  # each token an argmax
