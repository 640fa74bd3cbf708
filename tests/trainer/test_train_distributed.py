"""The trainer end to end under torchrun (2 CPU ranks, gloo, real vLLM): every tiny recipe,
value pretraining, exact resume, and a clean stop on SIGTERM."""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml

from megatron_rl.launch import free_port, kill_tree, run_torchrun
from tests.checkpoints import role_tensors, same_weights

pytestmark = pytest.mark.distributed

VARIED_REWARD = 'rewards.reward_fns=[{type: python, path: "tests.reward_fns:length_parity"}]'
# The VAPO recipe is sized for the learning demo; the tests run it small and without eval.
SMALL_VAPO = [
    "rollout.rollout_batch_size=4",
    "rollout.n_samples_per_prompt=4",
    "actor.ppo_mini_batch_size=8",
    "actor.micro_batch_size=4",
    "trainer.eval_data_path=null",
]


def train(recipe: str, out: Path, *overrides: str, timeout: float = 400):
    args = ["--config", f"examples/tiny/{recipe}.yaml", f"trainer.output_dir={out}", *overrides]
    return run_torchrun("megatron_rl.train", args, nproc=2, timeout=timeout)


def metrics(out: Path, stage: str = "train") -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["stage"] == stage]


def checkpoint(out: Path, progress: int) -> dict:
    """{role: its full tensors, or None} of checkpoint step_<progress>."""
    step_dir = out / "checkpoints" / f"step_{progress:06d}"
    return {role: role_tensors(step_dir, role) for role in ("actor", "critic")}


def finite(record: dict) -> bool:
    return all(
        v is not None and math.isfinite(v)
        for k, v in record.items()
        if k not in ("step", "stage", "critic/explained_variance")
    )


@pytest.fixture(scope="module")
def labelled_prompts(tmp_path_factory):
    """Prompts whose reward (+1 "good", -1 "bad") a critic can learn from the prompt alone."""
    path = tmp_path_factory.mktemp("data") / "good_bad.jsonl"
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(64):
        label = "good" if torch.rand(1, generator=g).item() < 0.5 else "bad"
        rows.append(json.dumps({"prompt": " ".join([label] * 4) + f" {i}", "answer": label}))
    path.write_text("\n".join(rows) + "\n")
    return path


def vapo_overrides(model_dir, data_path) -> list[str]:
    """4 value-pretraining + 4 PPO steps, a checkpoint after each, on prompt-labelled rewards."""
    return [
        *SMALL_VAPO,
        f"model.path={model_dir}",
        f"data.path={data_path}",
        'rewards.reward_fns=[{type: python, path: "tests.reward_fns:label_sign"}]',
        "critic.pretrain_steps=4",
        "critic.optim.lr=1e-3",
        "trainer.total_steps=4",
        "trainer.save_interval=1",
        "trainer.keep_last=20",
    ]


@pytest.fixture(scope="module")
def vapo_run(tiny_model_dir, labelled_prompts, tmp_path_factory):
    out = tmp_path_factory.mktemp("vapo") / "run"
    train("vapo", out, *vapo_overrides(tiny_model_dir, labelled_prompts))
    return out


def test_value_pretraining_raises_explained_variance_with_the_policy_frozen(vapo_run):
    records = metrics(vapo_run, "value_pretrain")
    ev = [r["critic/explained_variance"] for r in records]
    assert len(ev) == 4 and ev[-1] > ev[0] + 0.3 and ev[-1] > 0.5, ev
    first, last = checkpoint(vapo_run, 1), checkpoint(vapo_run, 4)
    assert same_weights(first["actor"], last["actor"])  # the policy is frozen
    assert not same_weights(first["critic"], last["critic"])


def test_vapo_recipe_trains_actor_and_critic(vapo_run):
    records = metrics(vapo_run)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(finite(r) for r in records), records
    assert all(r["logprob_gap_max"] < 1e-4 for r in records)  # engine = actor after each sync
    before, after = checkpoint(vapo_run, 4), checkpoint(vapo_run, 8)
    assert not same_weights(before["actor"], after["actor"])
    assert not same_weights(before["critic"], after["critic"])
    assert (vapo_run / "checkpoints" / "latest").read_text() == "step_000008"
    # The phase timers tools/bench_step_breakdown.py reads, and its arithmetic on them.
    from tools.bench_step_breakdown import breakdown

    shares = breakdown(records)
    assert shares["step_s"] > 0 and shares["generate_share"] > 0 and shares["train_share"] > 0
    total = sum(v for k, v in shares.items() if k.endswith("_share"))
    assert total == pytest.approx(1.0, abs=0.01)


def test_resume_after_step_2_reproduces_steps_3_and_4(
    vapo_run, tiny_model_dir, labelled_prompts, tmp_path
):
    resumed = tmp_path / "resumed"
    shutil.copytree(vapo_run, resumed)
    for late in ("step_000007", "step_000008"):
        shutil.rmtree(resumed / "checkpoints" / late)
    (resumed / "checkpoints" / "latest").write_text("step_000006")
    saved = json.loads(
        (vapo_run / "checkpoints" / "step_000006" / "trainer_state.json").read_text()
    )
    assert saved["step"] == 2 and saved["value_pretrain_step"] == 4
    cfg = yaml.safe_load((vapo_run / "checkpoints" / "step_000006" / "config.yaml").read_text())
    assert cfg["trainer"]["total_steps"] == 4  # the resolved config travels with the checkpoint
    train("vapo", resumed, *vapo_overrides(tiny_model_dir, labelled_prompts))

    def comparable(r):
        return {k: v for k, v in r.items() if not k.startswith("timing/") and k != "tokens_per_s"}

    # The rows of steps 3 and 4 the copy holds are dropped and logged again: one per step.
    expected = [comparable(r) for r in metrics(vapo_run)]
    got = [comparable(r) for r in metrics(resumed)]
    assert [r["step"] for r in got] == [1, 2, 3, 4] and got == expected
    assert len(metrics(resumed, "value_pretrain")) == 4
    assert same_weights(checkpoint(resumed, 8)["actor"], checkpoint(vapo_run, 8)["actor"])


def test_a_truncated_rank_file_is_named_and_the_previous_checkpoint_used(
    vapo_run, tiny_model_dir, labelled_prompts, tmp_path
):
    resumed = tmp_path / "resumed"
    shutil.copytree(vapo_run, resumed)
    root = resumed / "checkpoints"
    shard = root / "step_000008" / "actor" / "model" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])  # a save cut short by a full disk
    result = train("vapo", resumed, *vapo_overrides(tiny_model_dir, labelled_prompts))
    assert "step_000008: actor/model cannot be read" in result.output
    assert f"resuming from {root / 'step_000007'}" in result.output
    corrupt = root / ".step_000008.corrupt" / "actor" / "model" / "__1_0.distcp"
    assert corrupt.stat().st_size == 1000
    # Step 4 is redone from step 3's checkpoint and matches the uninterrupted run.
    assert (root / "latest").read_text() == "step_000008"
    assert same_weights(checkpoint(resumed, 8)["actor"], checkpoint(vapo_run, 8)["actor"])
    assert [r["step"] for r in metrics(resumed)] == [1, 2, 3, 4]


def test_a_new_run_refuses_an_output_dir_with_an_earlier_run(vapo_run, tiny_model_dir, tmp_path):
    reused = tmp_path / "reused"
    shutil.copytree(vapo_run, reused)
    overrides = [f"model.path={tiny_model_dir}", *SMALL_VAPO, "trainer.resume=false"]
    with pytest.raises(RuntimeError, match=r"holds an earlier run .*trainer.overwrite=true"):
        train("vapo", reused, *overrides, timeout=120)
    assert (reused / "checkpoints" / "step_000008").is_dir()  # nothing touched


@pytest.mark.parametrize(
    "recipe,has_critic", [("ppo", True), ("rloo", False), ("reinforce_pp", False)]
)
def test_recipe_runs_three_steps(recipe, has_critic, tiny_model_dir, tmp_path):
    out = tmp_path / recipe
    # PPO trains with full activation recompute (its exactness: test_memory_check_distributed).
    recompute = ["model.recompute.granularity=full"] if recipe == "ppo" else []
    train(
        recipe,
        out,
        f"model.path={tiny_model_dir}",
        VARIED_REWARD,
        "trainer.total_steps=3",
        "trainer.save_interval=1",
        "trainer.keep_last=5",
        *recompute,
    )
    records = metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3] and all(finite(r) for r in records), records
    first, last = checkpoint(out, 1), checkpoint(out, 3)
    assert not same_weights(first["actor"], last["actor"])
    if has_critic:
        assert not same_weights(first["critic"], last["critic"])
    else:
        assert last["critic"] is None and not any(k.startswith("critic/") for k in records[-1])


def test_sigterm_saves_a_complete_checkpoint_and_exits(tiny_model_dir, tmp_path):
    """SLURM pre-emption signals every process of the job; the run finishes its step, saves,
    and exits 0. The GRPO recipe (dynamic filtering, KL in the loss) runs 3 steps first."""
    out = tmp_path / "grpo"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--nnodes=1",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "megatron_rl.train",
        "--config", "examples/tiny/grpo.yaml", f"model.path={tiny_model_dir}", VARIED_REWARD,
        f"trainer.output_dir={out}", "trainer.total_steps=1000", "trainer.save_interval=1", "trainer.keep_last=1000",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            if (out / "metrics.jsonl").exists() and len(metrics(out)) >= 3:
                break
            time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        for p in tree:
            p.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # hung: no rank may outlive the test
            kill_tree(proc)
    records = metrics(out)
    assert len(records) >= 3 and all(finite(r) for r in records[:3]), output[-3000:]
    root = out / "checkpoints"
    latest = root / (root / "latest").read_text()
    state = json.loads((latest / "trainer_state.json").read_text())
    assert state["step"] == len(records) < 1000
    assert sorted(p.name for p in latest.iterdir()) == [
        "actor",
        "config.yaml",
        "rng",
        "trainer_state.json",
    ]
    assert not [p for p in root.iterdir() if p.name.endswith(".tmp")]
    assert not same_weights(checkpoint(out, 1)["actor"], role_tensors(latest, "actor"))
    assert f"saved checkpoint {latest}" in output


def test_a_resume_applies_the_configs_optimizer_settings(
    vapo_run, tiny_model_dir, labelled_prompts, tmp_path
):
    resumed = tmp_path / "resumed"
    shutil.copytree(vapo_run, resumed)
    overrides = [*vapo_overrides(tiny_model_dir, labelled_prompts), "actor.optim.lr=2e-4"]
    result = train("vapo", resumed, *overrides)  # step 4 of 4 is saved: nothing left to run
    assert "resume: actor optimizer settings from the config, not " in result.output
    assert "lr: 0.0001 -> 0.0002" in result.output
    assert "resume: critic optimizer" not in result.output  # unchanged: nothing to say
