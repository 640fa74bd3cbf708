"""A child process for user code that may hang or crash, and both of its ends.

The parent's end, `ChildProcess`, starts a plain `python -m MODULE READ_FD WRITE_FD`, not a
fork of the rank (which holds threads, process groups and a vLLM engine), in a session of its
own, so that a kill takes its whole process group: what the user code started (a sandbox, a
solver's helpers) goes with it. The child's end, `serve`, ignores the job's stop signals and
dies with its parent (`procutil.outlive_job_signals`), builds its object from the config the
parent sends, answers READY or ("error", why), then answers each request with the replies its
handler yields.

Time limits are the parent's: a reply that does not arrive in time gets the child killed.
What requests mean and whether a lost child is replaced are left to its users, `envs/pool.py`
(environment steps) and `rewards/isolated.py` (reward functions).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from megatron_rl.procutil import outlive_job_signals

READY = "ready"
CANCEL_POLL_S = 0.2
"""How often `receive` asks its `cancel` while waiting."""

Built = TypeVar("Built")


class ChildStartError(RuntimeError):
    """The child did not become ready (it is killed): its build failed (the message is the
    child's error), it died, or it did not answer within the start time limit."""


class ChildTimeout(Exception):
    """No reply within the time limit; the child has been killed and reaped."""

    def __init__(self, timeout_s: float):
        super().__init__(f"no answer in {timeout_s:g} s")


class ChildCancelled(Exception):
    """The caller's `cancel()` said yes while waiting: the child was killed and reaped."""


class ChildDied(Exception):
    """The child's pipe closed before its reply (a segfault, `os._exit`); it has been reaped."""

    def __init__(self, exit_code: int | None):
        super().__init__(f"its process died (exit code {exit_code})")
        self.exit_code = exit_code
        """None if it had not exited a second after closing its pipe (then it was killed)."""


class ChildProcess:
    """A child running `python -m module` (whose main is `serve`), built from `config` within
    `start_timeout_s`, and the two pipes to it."""

    def __init__(self, module: str, config: Any, start_timeout_s: float):
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        env = dict(os.environ)
        # The child imports the user's module the way the parent did.
        env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, str(to_child_r), str(from_child_w)],
            pass_fds=(to_child_r, from_child_w),
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: killed whole
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self._to_child = Connection(to_child_w, readable=False)
        self._from_child = Connection(from_child_r, writable=False)
        self.send(config)
        try:
            reply = self.receive(start_timeout_s)
        except (ChildTimeout, ChildDied) as e:
            raise ChildStartError(str(e)) from None
        if reply != READY:
            self.kill()
            raise ChildStartError(reply[1])

    def send(self, message: Any) -> None:
        """One request to the child (pickled; its replies come through `receive`)."""
        self._to_child.send(message)

    def receive(
        self, timeout_s: float | None = None, cancel: Callable[[], bool] | None = None
    ) -> Any:
        """The child's next message, waited for at most `timeout_s` (None: until it comes);
        raises `ChildTimeout` or `ChildDied`. `cancel`, asked every CANCEL_POLL_S while
        waiting: yes kills the child and raises `ChildCancelled` (a stop request need not
        wait for a slow call)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while True:
                left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                wait = left
                if cancel is not None:  # wake up to ask it
                    wait = CANCEL_POLL_S if left is None else min(CANCEL_POLL_S, left)
                if self._from_child.poll(wait):
                    return self._from_child.recv()
                if cancel is not None and cancel():
                    self.kill()
                    raise ChildCancelled
                if left is not None and left <= wait:
                    break
        except (EOFError, OSError):
            raise ChildDied(self._exit_code()) from None
        self.kill()
        raise ChildTimeout(timeout_s)

    def fileno(self) -> int:
        """The pipe the replies come on, for `multiprocessing.connection.wait` over children."""
        return self._from_child.fileno()

    def kill(self) -> None:
        """SIGKILL the child's process group, reap the child, close the pipes (again: no-op)."""
        # Not reaped yet: its pid is still the group's id and cannot name another process.
        if self.proc.returncode is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self._to_child.close()
        self._from_child.close()

    def _exit_code(self) -> int | None:
        # Its pipe closed: the process is exiting and its code is near; if it lingers, killed.
        try:
            code = self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            code = None
        self.kill()
        return code


def serve(build: Callable[[Any], Built], handle: Callable[[Built, Any], Iterable[Any]]) -> None:
    """The child's main, on the pipes `ChildProcess` named on its command line: `build(config)`
    from the parent's config, answered READY or ("error", why); then every reply
    `handle(built, request)` yields, sent as it comes, until the parent closes its pipe."""
    outlive_job_signals()
    inbox = Connection(int(sys.argv[1]), writable=False)
    out = Connection(int(sys.argv[2]), readable=False)
    config = inbox.recv()
    try:
        built = build(config)
    except ValueError as e:  # the config's own refusal (`load_callable`): it names the path
        out.send(("error", str(e)))
        return
    except Exception as e:
        out.send(("error", f"{type(e).__name__}: {e}"))
        return
    out.send(READY)
    while True:
        try:
            request = inbox.recv()
        except EOFError:  # the parent closed the pipe: done
            return
        for reply in handle(built, request):
            out.send(reply)
