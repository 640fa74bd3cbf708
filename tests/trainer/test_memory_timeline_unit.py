"""Unit tier: the memory timeline's phase rows and the hand-off before the engine wakes
(`trainer/memory_timeline.py`); the GPU half is marked and skipped without CUDA."""

import json

import pytest
import torch

from megatron_rl.trainer.memory_timeline import GIB, MemoryTimeline, release_cached_blocks


def test_phases_are_rows_and_metrics_and_a_cpu_hand_off_records_nothing(tmp_path):
    path = tmp_path / "memory_timeline.jsonl"
    timeline = MemoryTimeline(path, lambda: "asleep")
    with timeline.phase("train"):
        block = torch.ones(2**22, device="cpu")  # 16 MiB: the phase's peak holds it
    if not torch.cuda.is_available():
        assert release_cached_blocks() is None
    timeline.release_cached_blocks("wake_kv_cache")
    metrics = timeline.end_step(3, "train")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows[0]["phase"] == "train" and rows[0]["engine"] == "asleep"
    assert rows[0]["stage"] == "train" and rows[0]["step"] == 3
    assert metrics["memory/train_peak_gib"] == rows[0]["peak_gib"] >= block.nbytes / GIB
    if torch.cuda.is_available():
        assert rows[1]["hand_off"] == "wake_kv_cache" and len(rows) == 2
    else:  # no caching allocator between torch and the engine on a CPU: nothing to say
        assert len(rows) == 1 and list(metrics) == ["memory/train_peak_gib"]
    assert timeline.end_step(4, "train") == {}  # the rows went with step 3


@pytest.mark.gpu
def test_the_hand_off_gives_cached_blocks_back_and_says_how_much(tmp_path):
    timeline = MemoryTimeline(tmp_path / "t.jsonl", lambda: "weights")
    block = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    del block  # free to torch, still reserved by its allocator
    cached = torch.cuda.memory_reserved()
    timeline.release_cached_blocks("wake_kv_cache")
    (row,) = timeline.rows
    assert row["hand_off"] == "wake_kv_cache" and row["engine"] == "weights"
    assert row["reserved_gib_before"] * GIB == cached
    assert row["reserved_gib_before"] - row["reserved_gib_after"] >= 0.25
    metrics = timeline.end_step(1, "train")
    assert metrics["memory/wake_kv_cache_released_gib"] >= 0.25
