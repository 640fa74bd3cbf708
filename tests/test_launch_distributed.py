"""Distributed tier: the torchrun helper shows the failing rank's traceback and never hangs."""

import subprocess

import pytest

from megatron_rl.launch import TorchrunError, run_torchrun

pytestmark = pytest.mark.distributed


def test_failing_rank_traceback_is_reported():
    with pytest.raises(TorchrunError) as e:
        run_torchrun("tests.torchrun.misbehave", ["--mode", "fail-rank-1"], timeout=120)
    message = str(e.value)
    assert "deliberate failure on rank 1" in message
    assert "Traceback" in message and "rank      : 1" in message


def test_hung_job_is_killed_at_the_timeout():
    with pytest.raises(TorchrunError, match="timed out after 15s"):
        run_torchrun("tests.torchrun.misbehave", ["--mode", "hang"], timeout=15)
    leftover = subprocess.run(
        ["pgrep", "-f", "tests.torchrun.misbehave --mode hang"], capture_output=True, text=True
    )
    assert leftover.stdout.strip() == "", "a worker outlived the timeout"
