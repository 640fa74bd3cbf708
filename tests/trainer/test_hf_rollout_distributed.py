"""The trainer with `rollout.name=hf` (no vLLM) under torchrun: 2 CPU ranks, TP=2, so each
rank is an hf engine of its own and the replica splits the prompts over both; the actor
trains LoRA adapters, whose merged weights the hf engine takes whole at every sync."""

from __future__ import annotations

import os

import pytest

from tests.trainer.runs import VARIED_REWARD, finite, metrics, train

pytestmark = pytest.mark.distributed

TRIPWIRE = """import os
open(os.environ["VLLM_IMPORT_MARK"], "a").write("imported\\n")
raise ImportError("vllm was imported on the rollout.name=hf path")
"""


def test_grpo_trains_two_steps_with_the_hf_engine_and_never_imports_vllm(tiny_model_dir, tmp_path):
    # A `vllm` package ahead of the real one: importing it leaves a mark and fails.
    fake = tmp_path / "no_vllm" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(TRIPWIRE)
    mark = tmp_path / "vllm_imported"
    path = os.pathsep.join(p for p in (str(fake.parent), os.environ.get("PYTHONPATH")) if p)
    out = tmp_path / "grpo-hf"
    train(
        "grpo",
        out,
        f"model.path={tiny_model_dir}",
        "rollout.name=hf",
        VARIED_REWARD,
        "trainer.total_steps=2",
        "actor.lora.rank=8",
        "actor.optim.lr=1e-2",
        timeout=300,
        env={"PYTHONPATH": path, "VLLM_IMPORT_MARK": str(mark)},
    )
    assert not mark.exists(), "a rank imported vllm"
    records = metrics(out)
    assert [r["step"] for r in records] == [1, 2] and all(finite(r) for r in records), records
    for r in records:
        # fp32 engine and actor: the engine's sampling log-probs are the actor's after
        # every weight sync (step 2 samples from the synced, updated weights)
        assert r["rollout/logprob_gap/max"] < 1e-4, r
