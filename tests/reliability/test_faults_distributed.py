"""Faults a cluster run meets, injected into real runs (torchrun, 2 CPU ranks, real vLLM):
the stop signal of a scheduler or container runtime, a sampling judge that gives every rank
other rewards, a reward function stuck in C. Nothing may be lost, nothing may hang."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from megatron_rl.launch import free_port, kill_tree

# the journeys' tier (~35 s), to keep `make test` under 20 minutes
pytestmark = [pytest.mark.distributed, pytest.mark.e2e]

JUDGE = (
    'rewards.reward_fns=[{type: python, path: "tests.reward_fns:coin_flip_or_regex_hang", '
    'timeout_s: 0.3, kwargs: {calls_file: "%s"}}]'
)


def metrics(out) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["stage"] == "train"]


def test_sigterm_to_the_launcher_saves_and_exits_0_with_a_judge_that_differs_per_rank_and_hangs(
    tiny_model_dir, tmp_path
):
    """GRPO at TP=2 with dynamic filtering and one generation chunk per step (so a step can
    keep fewer groups than asked), rewarded by a coin flipped on each rank (without one
    scoring rank per model-parallel group each TP rank scores with its own coin: different
    advantages, different groups kept, different batch shapes in the next collective) that is stuck in C on a fifth of the responses (only a killed process
    stops it). After two steps the launcher alone gets SIGTERM, as from `docker stop` or
    SLURM's `--signal=B:TERM`: the workers save the last step boundary, and everything exits 0."""
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "megatron_rl.launch", "--nproc-per-node=2", "--nnodes=1",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "megatron_rl.cli.train",
        "--config", "examples/tiny/grpo.yaml", f"model.path={tiny_model_dir}",
        JUDGE % (tmp_path / "calls.txt"), "rollout.rating.max_num_gen_chunks=1",
        "rollout.rating.max_failure_ratio=0.6", f"trainer.output_dir={out}",
        "trainer.total_steps=1000", "trainer.save_interval=0",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 400
        while time.time() < deadline and proc.poll() is None and len(metrics(out)) < 2:
            time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:  # hung: no rank may outlive the test
            kill_tree(proc)
    assert proc.returncode == 0, output[-4000:]
    records = metrics(out)
    root = out / "checkpoints"
    latest = root / (root / "latest").read_text()
    # save_interval 0: this checkpoint exists only because of the signal, at the last step.
    assert json.loads((latest / "trainer_state.json").read_text())["step"] == len(records) >= 2
    # (and what the aborted step's rollout had generated, when the signal landed in a step)
    assert sorted(p.name for p in latest.iterdir() if p.name != "rollout_progress") == [
        "actor", "config.yaml", "rng", "trainer_state.json"
    ]  # fmt: skip
    aborted = "aborted in" in output
    assert (latest / "rollout_progress").is_dir() == aborted, output[-4000:]
    assert "launcher: SIGTERM: the workers save and stop" in output
    timeouts = sum(r.get("rollout/reward/python/failures", 0.0) for r in records)
    assert timeouts > 0, "no response hit the C hang: the test exercised nothing"
    calls = (tmp_path / "calls.txt").read_text().split()
    assert set(calls) == {"0"}, "a sample was scored on the other TP rank too"
