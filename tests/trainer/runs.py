"""Running `megatron_rl.cli.train` under torchrun in tests, and reading what a run left."""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch

from megatron_rl.launch import free_port, kill_tree, run_torchrun
from tests.checkpoints import role_tensors

VARIED_REWARD = 'rewards.reward_fns=[{type: python, path: "tests.reward_fns:length_parity"}]'
LABEL_REWARD = 'rewards.reward_fns=[{type: python, path: "tests.reward_fns:label_sign"}]'
# The VAPO recipe is sized for the learning demo; the tests run it small and without eval.
SMALL_VAPO = [
    "rollout.rollout_batch_size=4",
    "rollout.n_samples_per_prompt=4",
    "actor.ppo_mini_batch_size=8",
    "actor.micro_batch_size=4",
    "trainer.eval_data_path=null",
]


def train(recipe: str, out: Path, *overrides: str, timeout: float = 400, **torchrun):
    """`megatron_rl.cli.train` on a tiny recipe; `torchrun`: `run_torchrun`'s keywords."""
    args = ["--config", f"examples/tiny/{recipe}.yaml", f"trainer.output_dir={out}", *overrides]
    return run_torchrun("megatron_rl.cli.train", args, timeout=timeout, **torchrun)


def value_pretrain(recipe: str, out: Path, *overrides: str, timeout: float = 400):
    """`megatron_rl.cli.value_pretrain` (value pretraining alone) on a tiny recipe."""
    args = ["--config", f"examples/tiny/{recipe}.yaml", f"trainer.output_dir={out}", *overrides]
    return run_torchrun("megatron_rl.cli.value_pretrain", args, timeout=timeout)


def train_until_sigterm(recipe: str, out: Path, *overrides: str, after_steps: int) -> str:
    """Start a run as the sbatch script does (`megatron_rl.launch`); once `after_steps` PPO
    steps are logged, SIGTERM every process of it, helpers included (as SLURM's `scancel`
    does), and return its output once it has exited with no rank failing. (torchrun itself,
    signalled, exits 1 after its workers have saved and exited; SLURM records such a job as
    CANCELLED whatever the code.)"""
    cmd = [
        sys.executable, "-m", "megatron_rl.launch", "--nproc-per-node=2", "--nnodes=1",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "megatron_rl.cli.train",
        "--config", f"examples/tiny/{recipe}.yaml", f"trainer.output_dir={out}", *overrides,
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            if (out / "metrics.jsonl").exists() and len(metrics(out)) >= after_steps:
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
    assert not re.search(r"\[rank\d+\]: Traceback", output), output[-6000:]
    return output


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
        if k not in ("step", "stage", "critic/vf_explained_var")
    )


def write_labelled_prompts(path: Path) -> Path:
    """Prompts whose reward (+1 "good", -1 "bad") a critic can learn from the prompt alone."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(64):
        label = "good" if torch.rand(1, generator=g).item() < 0.5 else "bad"
        rows.append(json.dumps({"prompt": " ".join([label] * 4) + f" {i}", "answer": label}))
    path.write_text("\n".join(rows) + "\n")
    return path
