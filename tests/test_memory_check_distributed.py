"""The memory planner's estimate against the tensors a real Megatron actor holds on CPU
(`tools.memory_check`): one process, and two torchrun ranks with TP=2 + sequence parallel."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.models.presets import preset_arch

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("launcher", ["single", "torchrun_tp2_sp"])
def test_estimate_matches_the_tensors_a_real_actor_holds(launcher, tmp_path):
    """Model states to the byte, activations (saved-tensor hooks) within 2%, for no, selective
    and full recompute; TP=2 with sequence parallelism checks the sharded terms."""
    if launcher == "single":
        cmd = [sys.executable, "-m", "tools.memory_check", "--seq-length", "192"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", "29561", "-m", "tools.memory_check", "--tp", "2",
               "--sequence-parallel", "--micro-batch-size", "3", "--seq-length", "128"]  # fmt: skip
    proc = subprocess.run(
        cmd + ["--tolerance", "0.02"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [r["recompute"] for r in rows] == ["none", "selective", "full"]
    for row in rows:
        for part in ("weights", "grads", "optimizer"):
            assert row[f"{part}_estimated"] == row[f"{part}_measured"], (part, row)
        assert abs(row["activations_ratio"] - 1) <= 0.02, row
    # Recompute is exact: the same loss and gradient norm from the same weights and tokens.
    for key in ("pg_loss", "grad_norm"):
        assert rows[1][key] == pytest.approx(rows[0][key], rel=1e-6)
        assert rows[2][key] == pytest.approx(rows[0][key], rel=1e-6)
    none, selective, full = (r["activations_measured"] for r in rows)
    assert full < selective < none
    assert rows[2]["recomputes_measured"] == preset_arch("tiny").num_layers
