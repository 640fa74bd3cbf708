"""The memory planner's estimate against the tensors a real Megatron actor holds on CPU
(`tools.memory_check`), on two torchrun ranks with TP=2 and sequence parallelism."""

from __future__ import annotations

import json

import pytest

from megatron_rl.launch import run_torchrun
from megatron_rl.models.presets import preset_arch

pytestmark = pytest.mark.distributed


def test_estimate_matches_the_tensors_a_real_actor_holds():
    """Model states to the byte, activations (saved-tensor hooks) within 2%, for no, selective
    and full recompute, and for no recompute with the head's logits recomputed in backward
    (`logits_checkpointing`: no probabilities kept), at TP=2 with sequence parallelism (the
    sharded terms); recompute leaves the loss and gradient norm unchanged."""
    args = ["--tp", "2", "--sequence-parallel", "--micro-batch-size", "3",
            "--seq-length", "128", "--tolerance", "0.02"]  # fmt: skip
    result = run_torchrun("tools.memory_check", args, nproc=2, timeout=300)
    # rank 0's rows; the other rank's output can land on the same line after one: the first
    # object of each line is read
    decode = json.JSONDecoder().raw_decode
    rows = [decode(line)[0] for line in result.output.splitlines() if line.startswith("{")]
    assert [(r["recompute"], r["logits_checkpointing"]) for r in rows] == [
        ("none", False),
        ("selective", False),
        ("full", False),
        ("none", True),
    ]
    for row in rows:
        for part in ("weights", "grads", "optimizer"):
            assert row[f"{part}_estimated"] == row[f"{part}_measured"], (part, row)
        assert abs(row["activations_ratio"] - 1) <= 0.02, row
    # Recompute is exact: the same loss and gradient norm from the same weights and tokens.
    for key in ("pg_loss", "grad_norm"):
        for row in rows[1:]:
            assert row[key] == pytest.approx(rows[0][key], rel=1e-6)
    none, selective, full, lean_head = (r["activations_measured"] for r in rows)
    # with fused attention selective recompute keeps no less (no s x s scores to drop)
    assert full < none < selective
    # the head's kept fp32 probabilities: 3 x 128 tokens over a rank's 250 of 500 rows
    assert none - lean_head >= 3 * 128 * 250 * 4
    assert rows[2]["recomputes_measured"] == preset_arch("tiny").num_layers
