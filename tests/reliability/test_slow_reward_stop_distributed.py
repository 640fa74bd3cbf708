"""A stop during a reward slower than any grace time (45 s per call, as an LLM judge or a code
run can be): SIGTERM to the launcher alone, 5 s into step 3's scoring, through both launchers
(`megatron_rl.launch` and plain torchrun, which SIGKILLs its workers 30 s after forwarding the
signal). The reward call in flight is cancelled (its worker killed), the step aborts, step 2
is saved, every process is gone well inside torchrun's 30 s, and the resumed run goes on at
step 3."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from megatron_rl.launch import free_port, kill_tree
from tests.trainer.runs import metrics, train

pytestmark = [pytest.mark.distributed, pytest.mark.e2e]

REWARD = (
    'rewards.reward_fns=[{type: python, path: "tests.reward_fns:slow_once_flagged", '
    'timeout_s: 120, kwargs: {flag: "%s"}}]'
)
LAUNCHERS = {
    "megatron_rl.launch": ["megatron_rl.launch", "--nnodes=1", "--master-addr=127.0.0.1"],
    "torchrun": ["torch.distributed.run", "--nnodes=1", "--master-addr=127.0.0.1"],
}


# our launcher in front of torchrun: a variant, the trainer's stop handling is the same
@pytest.mark.parametrize(
    "launcher", [pytest.param("megatron_rl.launch", marks=pytest.mark.extended), "torchrun"]
)
def test_a_stop_during_a_slow_reward_is_saved_in_seconds_and_resumes(
    tiny_model_dir, tmp_path, launcher
):
    out, flag = tmp_path / "run", tmp_path / "slow"
    overrides = [
        f"model.path={tiny_model_dir}", REWARD % flag, f"trainer.output_dir={out}",
        "trainer.save_interval=1", "rollout.rating.max_num_gen_chunks=1",
        "rollout.rating.strategy=plain",
    ]  # fmt: skip
    cmd = [
        sys.executable, "-m", *LAUNCHERS[launcher], "--nproc-per-node=2",
        f"--master-port={free_port()}", "-m", "megatron_rl.cli.train",
        "--config", "examples/tiny/grpo.yaml", "trainer.total_steps=5", *overrides,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 400
        while time.time() < deadline and proc.poll() is None and len(metrics_of(out)) < 2:
            time.sleep(0.2)
        flag.touch()  # step 3's scoring: 45 s per call
        scoring = flag.with_name(flag.name + ".scoring")
        while time.time() < deadline and proc.poll() is None and not scoring.exists():
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        time.sleep(5)
        signalled = time.time()
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
        took = time.time() - signalled
    finally:
        if proc.poll() is None:  # hung: no rank may outlive the test
            kill_tree(proc)
    print(f"{launcher}: every process gone {took:.1f} s after SIGTERM")
    assert took < 30, f"{launcher} took {took:.0f} s to exit after SIGTERM:\n{output[-4000:]}"
    assert "aborted in rollout/score" in output, output[-4000:]
    root = out / "checkpoints"
    latest = root / (root / "latest").read_text()
    assert json.loads((latest / "trainer_state.json").read_text())["step"] == 2
    flag.unlink()
    train("grpo", out, *overrides, "trainer.total_steps=3", "trainer.resume=true")
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]


def metrics_of(out) -> list[dict]:
    return metrics(out) if (out / "metrics.jsonl").exists() else []
