"""Unit tier: `child_process` with real children (`tests/scripted_child.py`): replies
streamed, a child that hangs killed at its time limit with its process group and reaped, a
child that dies or fails to start reporting why."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from megatron_rl.child_process import (
    ChildCancelled,
    ChildDied,
    ChildProcess,
    ChildStartError,
    ChildTimeout,
)

CHILD = "tests.scripted_child"


def running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie is not: it only waits to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_hanging_child_is_killed_at_its_limit_with_its_process_group_and_reaped():
    child = ChildProcess(CHILD, {}, start_timeout_s=60.0)
    child.send(("echo", 1, 2))
    assert (child.receive(10.0), child.receive(10.0)) == (1, 2)
    child.send(("spawn_and_hang",))
    grandchild = child.receive(10.0)
    assert running(grandchild)
    start = time.monotonic()
    with pytest.raises(ChildTimeout, match=r"^no answer in 0.5 s$"):
        child.receive(0.5)
    assert time.monotonic() - start < 5.0
    assert child.proc.returncode == -signal.SIGKILL  # reaped: no zombie left
    assert not Path(f"/proc/{child.proc.pid}").exists()
    deadline = time.monotonic() + 5.0  # the kill is sent; its delivery is the kernel's
    while running(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(grandchild)
    child.kill()  # again: nothing left to do


def test_a_wait_cancelled_kills_the_child_at_once():
    child = ChildProcess(CHILD, {}, start_timeout_s=60.0)
    child.send(("spawn_and_hang",))
    child.receive(10.0)
    start = time.monotonic()
    with pytest.raises(ChildCancelled):
        child.receive(60.0, cancel=lambda: time.monotonic() - start > 0.5)
    assert 0.5 <= time.monotonic() - start < 10.0  # at the cancel, not at the 60 s limit
    assert child.proc.returncode == -signal.SIGKILL


def test_a_child_that_dies_reports_its_exit_code():
    child = ChildProcess(CHILD, {}, start_timeout_s=60.0)
    child.send(("exit", 3))
    with pytest.raises(ChildDied, match=r"^its process died \(exit code 3\)$") as died:
        child.receive(10.0)
    assert died.value.exit_code == 3 and child.proc.returncode == 3


@pytest.mark.parametrize(
    "config, message",
    [
        ({"refuse": "path 'x:y': no such module"}, "path 'x:y': no such module"),
        ({"crash": "no such maze"}, "RuntimeError: no such maze"),
        ({"exit": 4}, r"its process died \(exit code 4\)"),
        ({"hang": True}, "no answer in 1 s"),
    ],
)
def test_a_child_that_fails_to_start_says_why(config, message):
    start = time.monotonic()
    with pytest.raises(ChildStartError, match=rf"^{message}$"):
        ChildProcess(CHILD, config, start_timeout_s=1.0 if config.get("hang") else 60.0)
    assert time.monotonic() - start < 30.0
