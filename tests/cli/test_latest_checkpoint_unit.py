"""`megatron_rl.cli.latest_checkpoint`: what the sbatch script compares before and after a
start to tell progress, and a finished run, from a pre-emption that saved nothing new."""

from __future__ import annotations

import json

from megatron_rl.cli.latest_checkpoint import main


def run(capsys, out, total_steps: int) -> str:
    overrides = [f"trainer.output_dir={out}", f"trainer.total_steps={total_steps}"]
    main(["--config", "examples/tiny/vapo.yaml", *overrides])
    return capsys.readouterr().out.strip()


def save(out, name: str, step: int) -> None:
    path = out / "checkpoints" / name
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"step": step}))
    (out / "checkpoints" / "latest").write_text(name)


def test_names_the_checkpoint_a_resume_takes_and_whether_the_run_is_finished(capsys, tmp_path):
    assert run(capsys, tmp_path, 5) == "none"
    save(tmp_path, "step_000006", 2)  # 4 value-pretraining steps + 2 PPO steps
    assert run(capsys, tmp_path, 5) == "step_000006"
    assert run(capsys, tmp_path, 2) == "step_000006 finished"
    (tmp_path / "checkpoints" / ".step_000007.tmp").mkdir()  # a save that was killed
    assert run(capsys, tmp_path, 5) == "step_000006"
