"""A LoRA run end to end (`actor.lora`, `critic.lora`; 2 CPU ranks, TP=2, real vLLM): VAPO
with a KL term, so the reference (the actor with its adapters off) runs too. The engine
holds the merged weights after every sync, the checkpoints hold the adapters alone, a
resume redoes the steps exactly, and the Hugging Face export is the merged model with its
PEFT adapter beside it."""

from __future__ import annotations

import shutil

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForCausalLM

from megatron_rl.models.hf_mapping import HFCheckpointReader
from tests.tolerances import FP32_MODEL, assert_close
from tests.trainer.runs import (
    LABEL_REWARD,
    SMALL_VAPO,
    VARIED_REWARD,
    metrics,
    train,
    write_labelled_prompts,
)
from tests.trainer.test_train_distributed import measured

pytestmark = [pytest.mark.distributed, pytest.mark.e2e]  # two runs: ~2.5 min


def overrides(model_dir, data) -> list[str]:
    return [
        *SMALL_VAPO,
        f"model.path={model_dir}",
        f"data.path={data}",
        LABEL_REWARD,
        "critic.pretrain_steps=2",
        "trainer.total_steps=3",
        "trainer.save_interval=1",
        "trainer.keep_last=10",
        "trainer.save_hf_interval=3",
        "algorithm.kl_coef=0.05",
        "actor.lora.rank=8",
        "actor.lora.alpha=16",
        "actor.optim.lr=1e-2",
        "critic.lora.rank=8",
        "critic.optim.lr=1e-2",
    ]


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_run")
    data = write_labelled_prompts(root / "good_bad.jsonl")
    out = root / "run"
    result = train("vapo", out, *overrides(tiny_model_dir, data))
    return out, data, result


def test_the_reference_is_the_base_and_the_engine_the_merged_actor(lora_run):
    out, _, _ = lora_run
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # B = 0 at the start: the actor is its base, so the reward KL is exactly 0, then grows
    assert rows[0]["actor/reward_kl"] == 0.0
    assert rows[-1]["actor/reward_kl"] > 1e-4
    for r in rows:  # the engine's log-probs are the trainer's after every merged sync
        assert r["rollout/logprob_gap/max"] <= 1e-4, r["rollout/logprob_gap/max"]
        assert r["actor/update_ok"] and r["critic/update_ok"]


def test_checkpoints_hold_the_adapters_and_the_value_head_alone(lora_run):
    out, _, _ = lora_run
    step = out / "checkpoints" / "step_000005"
    for role in ("actor", "critic"):
        keys = FileSystemReader(str(step / role / "model")).read_metadata().state_dict_metadata
        model = {k for k in keys if not k.startswith("optimizer.")}
        adapters = {k for k in model if k.endswith((".lora_A", ".lora_B"))}
        assert adapters and model - adapters == (
            {"output_layer.weight"} if role == "critic" else set()
        )


def test_a_resume_redoes_the_steps_exactly(lora_run, tiny_model_dir, tmp_path):
    out, data, _ = lora_run
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    for late in ("step_000004", "step_000005"):
        shutil.rmtree(resumed / "checkpoints" / late)
    (resumed / "checkpoints" / "latest").write_text("step_000003")
    result = train("vapo", resumed, *overrides(tiny_model_dir, data))
    assert f"resumed from {resumed / 'checkpoints' / 'step_000003'} (step 1)" in result.output
    assert [measured(r) for r in metrics(resumed)] == [measured(r) for r in metrics(out)]


def test_the_export_is_the_merged_model_and_its_peft_adapter(lora_run, tiny_model_dir):
    out, _, _ = lora_run
    export = out / "hf" / "step_000003"
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    adapter = load_file(export / "adapter" / "adapter_model.safetensors")
    assert adapter and max(t.abs().max() for k, t in adapter.items() if "lora_B" in k) > 0
    merged = PeftModel.from_pretrained(base, export / "adapter").merge_and_unload()
    exported = HFCheckpointReader(export)
    for name, tensor in merged.state_dict().items():
        assert_close(exported(name), tensor, FP32_MODEL, name)


def test_adapters_served_by_vllm_give_the_trainers_log_probs_at_every_step(
    tiny_model_dir, tmp_path
):
    """`actor.lora.merge: false`: RLOO with a KL term for two steps, the engine holding the
    base once and serving each update's adapters as a LoRA request; its log-probs are the
    trainer's at every step (the adapters moved the policy: the KL to the base grows)."""
    out = tmp_path / "run"
    train(
        "rloo", out, f"model.path={tiny_model_dir}", VARIED_REWARD, "trainer.total_steps=2",
        "actor.lora.rank=8", "actor.lora.alpha=16", "actor.lora.merge=false",
        "actor.optim.lr=1e-2", "algorithm.kl_coef=0.05",
    )  # fmt: skip
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["actor/reward_kl"] == 0.0 and rows[-1]["actor/reward_kl"] > 1e-4
    for r in rows:
        assert r["rollout/logprob_gap/max"] <= 1e-4, r["rollout/logprob_gap/max"]
    # the newest sync's adapter alone is left, as PEFT writes one
    (newest,) = (out / ".adapter_sync").iterdir()
    assert newest.name == "000002"  # one per step (the engine started from the base)
    assert sorted(f.name for f in newest.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
