"""On PYTHONPATH of a SLURM test job: a training worker (`python -m megatron_rl.cli.train`) with
$MEGATRON_RL_HOLD_AT (STAGE:STEP:PHASE, `tests/torchrun/stop_in_phase.py`) set makes that
point of its step last until a stop request arrives: rank 0 writes $MEGATRON_RL_HOLD_MARKER
("held") and waits for the stop file the batch script's signal trap creates. The test sends
the scheduler's signal once the marker exists, so the signal lands inside that phase (a long
generation, say) every time instead of by the luck of timing. Once the marker exists (a
requeued start) nothing is held. Every other process of the job (the launcher, torchrun,
vLLM's helpers) is left alone."""

import os
import sys
from pathlib import Path


def _install() -> None:
    argv = sys.orig_argv
    is_worker = "-m" in argv and argv[argv.index("-m") + 1 :][:1] == ["megatron_rl.cli.train"]
    hold_at, marker = (
        os.environ.get("MEGATRON_RL_HOLD_AT"),
        os.environ.get("MEGATRON_RL_HOLD_MARKER"),
    )
    if not (is_worker and hold_at and marker) or Path(marker).exists():
        return
    from tests.torchrun.stop_in_phase import install, wait_for_request

    def hold(rank: int) -> None:
        if rank == 0:
            Path(marker).write_text("held\n")
            wait_for_request(timeout_s=300.0)

    install(hold_at, hold)


_install()
