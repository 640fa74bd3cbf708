"""Print the checkpoint a run would resume from: `step_N` (N = value-pretraining steps +
training steps done), followed by ` finished` when it holds the last step
(`trainer.total_steps`); `none` before the first. The sbatch script compares it before and
after a job's run: a pre-empted run that saved nothing new is not requeued forever, and a
finished one is not requeued at all.

    python -m megatron_rl.cli.latest_checkpoint --config examples/tiny/vapo.yaml [key=value ...]
"""

from __future__ import annotations

import json

from megatron_rl.cli.train import parse_args
from megatron_rl.trainer.checkpoint import CheckpointManager


def main(argv=None) -> None:
    config = parse_args(argv, __doc__)

    latest = CheckpointManager(output_dir=config.trainer.output_dir, rank=0, world_size=1).latest()
    if latest is None:
        print("none")
        return
    state = json.loads((latest / "trainer_state.json").read_text())
    finished = state["step"] >= config.trainer.total_steps
    print(latest.name + (" finished" if finished else ""))


if __name__ == "__main__":
    main()
