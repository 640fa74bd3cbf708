"""Checkpoint directories that cannot be corrupted: pruning, `latest`, unreadable rank files,
the metrics rows of a resumed run (one process, a world-size-1 gloo group)."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_rl.config import load_config
from megatron_rl.trainer.checkpoint import (
    CheckpointManager,
    CorruptCheckpoint,
    clear_previous_run,
    previous_run_files,
)
from megatron_rl.trainer.metrics import MetricsLogger, row_position


@pytest.fixture(scope="module", autouse=True)
def _world(world_of_one):
    pass


def save(manager: CheckpointManager, step: int, value: float = 0.0):
    """A checkpoint with no roles (they are megatron distributed checkpoints, tested under
    torchrun) and `value` standing in for this rank's RNG state."""
    return manager.save(
        step, lambda out: None, {"w": torch.full((2,), value)}, {"step": step}, "config: {}\n"
    )


def names(root):
    return sorted(p.name for p in root.iterdir())


def test_pruning_keeps_the_newest_of_this_run_and_never_a_later_one(tmp_path):
    # An earlier, longer run left step_000050 (complete): it is not this run's to prune, and
    # the new checkpoints must survive (the old rule kept the highest-numbered ones).
    earlier = CheckpointManager(output_dir=tmp_path, rank=0, world_size=1, keep_last=1)
    save(earlier, 50)
    manager = CheckpointManager(output_dir=tmp_path, rank=0, world_size=1, keep_last=2)
    for step in (1, 2, 3):
        save(manager, step)
    root = tmp_path / "checkpoints"
    assert names(root) == ["latest", "step_000002", "step_000003", "step_000050"]
    assert (root / "latest").read_text() == "step_000003"


def test_keep_last_below_one_is_refused_before_anything_is_deleted(tmp_path):
    with pytest.raises(ValueError, match="keep_last must be >= 1, got 0"):
        CheckpointManager(output_dir=tmp_path, rank=0, world_size=1, keep_last=0)
    with pytest.raises(ValueError, match=r"config section trainer: keep_last must be >= 1, got -1"):
        load_config("examples/tiny/vapo.yaml", ["trainer.keep_last=-1"])
    for bad, message in [
        ("actor.ppo_epochs=0", "ppo_epochs must be >= 1, got 0"),
        ("trainer.total_steps=-3", "total_steps must be >= 0, got -3"),
        ("rollout.rollout_batch_size=0", "rollout_batch_size must be >= 1, got 0"),
        ("trainer.overwrite=true", "overwrite: true replaces an earlier run, so it needs resume"),
    ]:
        with pytest.raises(ValueError, match=message):
            load_config("examples/tiny/vapo.yaml", [bad])


def test_latest_naming_a_missing_checkpoint_falls_back_to_the_newest_complete(tmp_path, capsys):
    manager = CheckpointManager(output_dir=tmp_path, rank=0, world_size=1, keep_last=5)
    for step in (1, 2):
        save(manager, step)
    root = tmp_path / "checkpoints"
    (root / ".step_000003.tmp").mkdir()  # a save cut short: never complete
    (root / "latest").write_text("step_000009")
    assert manager.latest() == root / "step_000002"
    assert "names step_000009, which is not a complete checkpoint" in capsys.readouterr().out
    (root / "latest").unlink()
    assert manager.latest() == root / "step_000002"


def test_an_unreadable_rank_file_is_named_and_set_aside(tmp_path):
    manager = CheckpointManager(output_dir=tmp_path, rank=0, world_size=1, keep_last=5)
    first, second = save(manager, 1, 1.0), save(manager, 2, 2.0)
    shard = second / "rng" / "rank_00000.pt"
    shard.write_bytes(shard.read_bytes()[:20])
    with pytest.raises(CorruptCheckpoint, match=r"step_000002: rng/rank_00000.pt \(rank 0\)"):
        manager.load(second)
    assert manager.previous(second) == first and manager.previous(first) is None
    aside = manager.set_aside(second)
    assert aside.name == ".step_000002.corrupt" and (aside / "rng" / "rank_00000.pt").exists()
    assert manager.latest() == first
    state, trainer_state = manager.load(first)
    assert torch.equal(state["w"], torch.ones(2)) and trainer_state["step"] == 1


def test_at_another_layout_the_rng_states_are_not_restored(tmp_path, capsys):
    """The roles reshard (tests/trainer/test_reshard_distributed.py); the per-rank RNG
    states cannot, and the resume says so."""
    tp2 = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1}
    path = save(CheckpointManager(output_dir=tmp_path, rank=0, world_size=1, layout=tp2), 1, 3.0)
    assert json.loads((path / "trainer_state.json").read_text())["layout"] == tp2
    pp2 = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 2}
    rng, trainer_state = CheckpointManager(
        output_dir=tmp_path, rank=0, world_size=1, layout=pp2
    ).load(path)
    assert rng is None and trainer_state["step"] == 1
    assert "weights and optimizer state reshard" in capsys.readouterr().out
    rng, _ = CheckpointManager(output_dir=tmp_path, rank=0, world_size=1, layout=tp2).load(path)
    assert torch.equal(rng["w"], torch.full((2,), 3.0))


def test_a_checkpoint_of_the_old_per_rank_format_is_refused_by_name(tmp_path):
    path = save(CheckpointManager(output_dir=tmp_path, rank=0, world_size=1), 1)
    (path / "rank_00000.pt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"step_000001: per-rank torch files \(rank_\*.pt\)"):
        CheckpointManager(output_dir=tmp_path, rank=0, world_size=1).load(path)


def test_an_earlier_run_is_found_and_cleared_whole(tmp_path):
    assert previous_run_files(tmp_path) == []
    save(CheckpointManager(output_dir=tmp_path, rank=0, world_size=1), 4)
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "tensorboard").mkdir()
    found = previous_run_files(tmp_path)
    assert found == [tmp_path / "metrics.jsonl", tmp_path / "checkpoints" / "step_000004"]
    clear_previous_run(tmp_path)
    assert previous_run_files(tmp_path) == [] and names(tmp_path) == []


def test_a_resume_drops_the_metrics_rows_of_the_steps_it_redoes(tmp_path):
    rows = [
        {"stage": "value_pretrain", "step": 1},
        {"stage": "value_pretrain", "step": 2},
        {"stage": "eval", "step": 0},
        {"stage": "train", "step": 1},
        {"stage": "train", "step": 2},
        {"stage": "train", "step": 3},
    ]
    assert [row_position(r) for r in rows] == [(0, 1), (0, 2), (1, 0.5), (1, 1), (1, 2), (1, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    logger = MetricsLogger(output_dir=tmp_path, total_steps=3, enabled=True)
    assert logger.rewind((1, 1)) == 2  # resumed after PPO step 1: steps 2 and 3 are redone
    logger.log(2, {"reward/mean": 0.5})
    logger.close()
    got = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["stage"], r["step"]) for r in got] == [
        ("value_pretrain", 1),
        ("value_pretrain", 2),
        ("eval", 0),
        ("train", 1),
        ("train", 2),
    ]
    logger = MetricsLogger(output_dir=tmp_path, total_steps=3, enabled=True)
    assert logger.rewind((1, 0)) == 3  # resumed at step 0: the step-0 eval runs again
    logger.close()


def test_optimizer_settings_come_from_the_config_also_after_a_resume():
    """torch's load_state_dict brings back the saved schedule bounds; the config's are applied
    again (the lr itself is the schedule's: test_lr_schedule_unit), and megatron's no-decay
    groups (biases, norms: wd_mult 0) keep no weight decay."""
    from megatron_rl.workers.optimizer import OptimConfig, apply_hyperparameters

    weight, bias = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))
    groups = [{"params": [weight], "wd_mult": 1.0}, {"params": [bias], "wd_mult": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.1)
    assert apply_hyperparameters(opt, OptimConfig(lr=1e-3, weight_decay=0.1)) == [
        "max_lr: None -> 0.001",
        "min_lr: None -> 0.0",
        "weight_decay: 0.1 -> 0.0",
    ]
    saved = opt.state_dict()
    new = OptimConfig(lr=2e-4, weight_decay=0.1, adam_beta2=0.95)
    opt.load_state_dict(saved)
    changed = apply_hyperparameters(opt, new)
    assert changed == ["max_lr: 0.001 -> 0.0002", "betas: (0.9, 0.999) -> (0.9, 0.95)"]
    assert [g["max_lr"] for g in opt.param_groups] == [2e-4, 2e-4]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert apply_hyperparameters(opt, new) == []
