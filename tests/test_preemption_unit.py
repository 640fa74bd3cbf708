"""Stop requests (`megatron_rl.preemption`): when one was made, and the warning for a run
that plain torchrun started."""

import os
import signal
from datetime import timedelta

import pytest
import torch.distributed as dist

from megatron_rl.preemption import (
    SHARED_KEY,
    STOP_FILE_ENV,
    StepAborted,
    StopRequest,
    grace_warning,
    plain_torchrun_warning,
    request_stop,
)


def test_a_signal_is_a_request_dated_by_its_first_arrival(monkeypatch):
    monkeypatch.delenv(STOP_FILE_ENV, raising=False)
    stop = StopRequest()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        stop.install()
        assert not stop.requested and stop.since is None
        os.kill(os.getpid(), signal.SIGUSR1)
        first = stop.since
        os.kill(os.getpid(), signal.SIGTERM)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert stop.reason == "SIGTERM" and stop.since == first is not None


def test_a_stop_file_is_a_request_dated_by_the_file(monkeypatch, tmp_path):
    path = tmp_path / "stop"
    monkeypatch.setenv(STOP_FILE_ENV, str(path))
    stop = StopRequest()
    assert not stop.requested and stop.since is None
    request_stop(path, "SIGTERM to the launcher")
    assert stop.reason == f"stop file {path}" and stop.since == path.stat().st_mtime


def test_a_request_one_process_sees_reaches_the_others_through_the_jobs_store(monkeypatch):
    """Two ranks' StopRequests on one real TCPStore (what torchrun's workers share): a signal
    only rank 1 got is published at its first check and read by rank 0 at its next, with the
    signal's time; nothing is published before, and rank 1 keeps its own reason."""
    monkeypatch.delenv(STOP_FILE_ENV, raising=False)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
    rank0, rank1 = StopRequest(), StopRequest()
    rank0.share_through(server, 0)
    rank1.share_through(client, 1)
    assert not rank0.requested and not rank1.requested and rank0.since is None
    rank1._on_signal(signal.SIGTERM, None)  # as its handler does; the store is not touched there
    assert not server.check([SHARED_KEY])
    assert rank1.reason == "SIGTERM"  # its first check publishes it
    assert rank0.reason == "SIGTERM on rank 1" and rank0.since == rank1.since is not None


def test_plain_torchrun_gets_a_warning_naming_its_shutdown_timeout():
    torchrun = {"TORCHELASTIC_RUN_ID": "none", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "120"}
    warning = plain_torchrun_warning(torchrun)
    assert "SIGKILLs them 120 s later" in warning and "megatron_rl.launch" in warning
    assert "30 s later" in plain_torchrun_warning({"TORCHELASTIC_RUN_ID": "none"})
    assert plain_torchrun_warning({**torchrun, STOP_FILE_ENV: "/tmp/stop"}) is None  # launcher
    assert plain_torchrun_warning({}) is None  # not torchrun at all


@pytest.mark.parametrize("phase", ["rollout/score", "experience/critic"])
def test_step_aborted_names_its_phase(phase):
    e = StepAborted(phase)
    assert e.phase == phase and phase in str(e)


def test_grace_warnings_name_the_time_and_the_setting():
    assert grace_warning("this save", 100.0, None) is None  # not known: nothing to compare
    assert grace_warning("this save", 29.0, 60.0) is None
    slow = grace_warning("this save", 31.0, 60.0)
    assert "this save took 31.0 s, more than half of trainer.stop_grace_s=60" in slow
    assert grace_warning("this stop", 59.0, 60.0) is None  # a whole stop may use all of it
    assert "more than all of trainer.stop_grace_s=60" in grace_warning("this stop", 61.0, 60.0)
