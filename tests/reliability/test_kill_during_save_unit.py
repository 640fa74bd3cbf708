"""A run SIGKILLed while it saves (node failure, OOM killer, SLURM's KillWait): the checkpoint
being written is never taken for a complete one, `latest` keeps naming the previous one, and
the next run saves over the debris."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import torch

from megatron_rl.trainer.checkpoint import CheckpointManager

# Saves step 1, then step 2 with `point` patched to announce itself and block: the parent
# kills the process there.
SAVER = """
import os, sys, time, torch
from megatron_rl.trainer import checkpoint
out, point = sys.argv[1], sys.argv[2]
torch.distributed.init_process_group("gloo", init_method="file://" + out + "/store", rank=0, world_size=1)
m = checkpoint.CheckpointManager(output_dir=out, rank=0, world_size=1, keep_last=1)
m.save(1, lambda out: None, {"w": torch.ones(2)}, {"step": 1}, "")
def stuck(real):
    def at_the_kill_point(*args, **kwargs):
        if point == "after":
            real(*args, **kwargs)
        print("in", flush=True)
        time.sleep(600)
    return at_the_kill_point
if point in ("rank_file", "after"):
    checkpoint.torch.save = stuck(checkpoint.torch.save)
else:  # the `latest` pointer, the checkpoint itself already renamed
    checkpoint.os.replace = stuck(checkpoint.os.replace)
m.save(2, lambda out: None, {"w": torch.full((2,), 2.0)}, {"step": 2}, "")
"""


@pytest.mark.parametrize("point", ["rank_file", "after", "latest"])
def test_a_kill_during_save_loses_nothing_saved(point, tmp_path, world_of_one):
    proc = subprocess.Popen(
        [sys.executable, "-c", SAVER, str(tmp_path), point], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "in"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    m = CheckpointManager(output_dir=tmp_path, rank=0, world_size=1, keep_last=1)
    complete = [p.name for p in m.complete()]
    if point == "latest":  # step 2 was complete; `latest` still names step 1, which is kept
        assert complete == ["step_000001", "step_000002"]
    else:
        assert complete == ["step_000001"]
    assert m.latest().name == "step_000001"
    state, trainer_state = m.load(m.latest())
    assert trainer_state["step"] == 1 and torch.equal(state["w"], torch.ones(2))
    # The resumed run saves step 2 again, over whatever the killed save left.
    m.save(2, lambda out: None, {"w": torch.full((2,), 3.0)}, {"step": 2}, "")
    assert [p.name for p in m.complete()] == ["step_000002"]  # keep_last 1: step 1 pruned now
    assert m.latest().name == "step_000002"
    assert not list((tmp_path / "checkpoints").glob(".*.tmp"))
    assert torch.equal(m.load(m.latest())[0]["w"], torch.full((2,), 3.0))
