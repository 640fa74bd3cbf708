"""No hang is silent (`trainer/watchdog.py`): a rank stalls in its reward function while the
other waits in the next collective. The step watchdog ends the run naming the step, the phase,
where each rank is and which ranks did not arrive; with the watchdog off, the process group's
timeout ends it, and the error names the phases (real torchrun, 2 CPU ranks, real vLLM)."""

from __future__ import annotations

import re
import time

import pytest

from megatron_rl.launch import TorchrunError
from tests.trainer.runs import train

pytestmark = [pytest.mark.distributed, pytest.mark.e2e]

STALL = 'rewards.reward_fns=[{type: python, path: "tests.reward_fns:stalls_on_rank_1", timeout_s: 3600}]'


def stalled_run(model_dir, out, *overrides) -> tuple[str, float]:
    """(the output, seconds) of a PPO run whose rank 1 stalls in the first rollout's scoring."""
    start = time.monotonic()
    with pytest.raises(TorchrunError) as failed:
        train("ppo", out, f"model.path={model_dir}", STALL, *overrides, timeout=300)
    return str(failed.value), time.monotonic() - start


def test_the_step_watchdog_names_the_phase_where_each_rank_is_and_who_did_not_arrive(
    tiny_model_dir, tmp_path
):
    output, seconds = stalled_run(tiny_model_dir, tmp_path / "run", "trainer.step_timeout_s=20")
    assert "watchdog: train step 1 ran 2" in output, output
    assert "over trainer.step_timeout_s=20: ending the run" in output
    collectives = "megatron_rl/parallel/collectives.py"
    assert re.search(
        rf"rank 0, train step 1 / rollout: waits in a collective \(all_reduce\) called from "
        rf"{collectives}:\d+ any_rank",  # the abort point after the rollout (RLTrainer.abort_point)
        output,
    ), output
    # rank 1 waits for its reward function's child process (rewards/isolated.py)
    assert re.search(
        r"rank 1, train step 1 / rollout: at megatron_rl/child_process.py:\d+ receive", output
    ), output
    assert re.search(
        rf"ranks \[0\] wait in all_reduce from {collectives}:\d+ any_rank; "
        r"ranks \[1\] did not arrive there",
        output,
    ), output
    assert "exitcode: 3" in output  # the watchdog's, not a kill's
    # start-up (~40 s on 2 cores) + the 20 s timeout + the report: never the hour of the stall
    assert seconds < 200


@pytest.mark.extended  # the watchdog's own report is the test above
def test_with_the_watchdog_off_the_collective_timeout_ends_it_naming_the_phases(
    tiny_model_dir, tmp_path
):
    output, _ = stalled_run(
        tiny_model_dir,
        tmp_path / "run",
        "trainer.step_timeout_s=null",
        "parallel.distributed_timeout_minutes=0.25",
    )
    # gloo's own error on rank 0 (torchrun then stops rank 1, SIGKILLing it 30 s later: a
    # stalled rank does not act on SIGTERM) ...
    assert "Timed out waiting 15000ms" in output, output
    # ... with the note naming its phase and the phase rank 1 never left
    assert "megatron_rl watchdog: rank 0 was in train step 1 / rollout" in output, output
    assert re.search(r"rank 1 last entered train step 1 / rollout \d+ s ago", output), output
