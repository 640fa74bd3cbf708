"""Distributed tier: the torchrun helper shows the failing rank's traceback and never hangs."""

import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_rl import launch
from megatron_rl.launch import (
    RANKS_AS_NODES_ENV,
    SHUTDOWN_TIMEOUT_S,
    TorchrunError,
    free_port,
    kill_tree,
    run_torchrun,
)

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


def test_a_node_per_rank_gives_every_rank_local_rank_0_and_a_nccl_host_of_its_own(monkeypatch):
    """MEGATRON_RL_RANKS_AS_NODES=1 (how two ranks share one GPU under NCCL): one job of
    world 2 all the same, every rank LOCAL_RANK 0 (cuda:0), a NCCL_HOSTID each."""
    monkeypatch.setenv(RANKS_AS_NODES_ENV, "1")
    out = run_torchrun("tests.torchrun.misbehave", ["--mode", "whoami"], timeout=120).output
    pattern = r"whoami rank=(\d) local_rank=(\d) world=(\d) hostid=(megatron_rl-node-\d|None)"
    seen = sorted(re.findall(pattern, out))
    assert [(r, lr, w) for r, lr, w, _ in seen] == [("0", "0", "2"), ("1", "0", "2")], out
    assert len({h for *_, h in seen}) == 2 and "None" not in {h for *_, h in seen}


@pytest.mark.e2e  # the journeys' tier (~30 s), to keep `make test` under 20 minutes
def test_a_node_per_rank_reports_the_failing_rank_and_kills_a_hung_job(monkeypatch):
    monkeypatch.setenv(RANKS_AS_NODES_ENV, "1")
    with pytest.raises(TorchrunError, match="a node per rank") as e:
        run_torchrun("tests.torchrun.misbehave", ["--mode", "fail-rank-1"], timeout=120)
    assert "deliberate failure on rank 1" in str(e.value)
    with pytest.raises(TorchrunError, match=r"\(a node per rank\) timed out after 15s"):
        run_torchrun("tests.torchrun.misbehave", ["--mode", "hang"], timeout=15)
    leftover = subprocess.run(
        ["pgrep", "-f", "tests.torchrun.misbehave --mode hang"], capture_output=True, text=True
    )
    assert leftover.stdout.strip() == "", "a worker outlived the timeout"


@pytest.mark.parametrize(
    "as_nodes",
    # node-per-rank: the journeys' tier (~25 s), to keep `make test` under 20 minutes
    [False, pytest.param(True, marks=pytest.mark.e2e)],
    ids=["local", "node-per-rank"],
)
def test_a_launch_whose_port_was_taken_is_repeated_on_a_fresh_port(monkeypatch, as_nodes):
    """`free_port` can hand out a port another process binds before torchrun does (seen on
    the GPU machine): the rendezvous fails with EADDRINUSE before any worker starts, and the
    job is launched again on a new port; a port taken on every try still fails, saying so."""
    if as_nodes:
        monkeypatch.setenv(RANKS_AS_NODES_ENV, "1")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        handed = iter([port])
        monkeypatch.setattr(launch, "free_port", lambda: next(handed, None) or free_port())
        out = run_torchrun("tests.torchrun.misbehave", ["--mode", "whoami"], timeout=120).output
        assert "EADDRINUSE" not in out and len(re.findall(r"whoami rank=\d", out)) == 2, out

        monkeypatch.setattr(launch, "free_port", lambda: port)
        with pytest.raises(TorchrunError, match="EADDRINUSE"):
            run_torchrun("tests.torchrun.misbehave", ["--mode", "whoami"], timeout=120)


def test_a_signal_to_the_launcher_before_its_workers_exist_is_honoured_by_them():
    """SIGUSR1 to `megatron_rl.launch` as soon as it has started torchrun (whose workers do
    not exist yet): the request waits in the stop file, the workers find it when they start,
    nobody dies of the signal, everything exits 0, and the launcher's own file is gone. The
    workers see the shutdown timeout the launcher gave torchrun."""
    cmd = [
        sys.executable, "-m", "megatron_rl.launch", "--nproc-per-node=2", "--nnodes=1",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}",
        "-m", "tests.torchrun.misbehave", "--mode", "wait-for-stop",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        launcher = psutil.Process(proc.pid)
        deadline = time.time() + 30
        while not launcher.children() and time.time() < deadline:  # handlers are installed
            time.sleep(0.01)
        assert not launcher.children()[0].children(), "workers already started: test too slow"
        proc.send_signal(signal.SIGUSR1)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    assert proc.returncode == 0, output[-4000:]
    stop_file = re.search(r"launcher: SIGUSR1: the workers save and stop \((\S+)\)", output)
    assert stop_file, output[-4000:]
    for rank in (0, 1):
        assert f"rank {rank} stops: stop file {stop_file[1]}" in output
    assert not Path(stop_file[1]).exists()
    # given in the environment, not as `--shutdown-timeout`, which torch 2.11's torchrun refuses
    assert f"shutdown timeout {SHUTDOWN_TIMEOUT_S}" in output, output[-4000:]
