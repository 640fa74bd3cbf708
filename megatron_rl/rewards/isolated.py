"""Reward functions run in a child process that is killed when a call outlives its time limit.

A time limit inside the trainer's process cannot stop a reward function stuck in C code that
holds the GIL (a catastrophic regular expression, a solver): SIGALRM is only handled between
bytecodes, and a thread cannot be killed. So user (`python`) and `math` functions with a
`timeout_s` run in a child process: the trainer sends it a batch, the child streams back one
result per sample (one per batch for batched functions), and a result that does not arrive in
time gets the child SIGKILLed and restarted; that sample (or batch) counts as a failure and
the rest of the batch goes to the new child. A child that dies (segfault, `os._exit`) is a
failure of the sample it was scoring, not of the run.

The child is a plain `python -m megatron_rl.rewards.isolated`, not a fork of the trainer (which
holds threads, process groups and a vLLM engine); it builds the function from its config, so
import errors still surface when the scorer is built, before any model.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from multiprocessing.connection import Connection

from megatron_rl.procutil import outlive_job_signals
from megatron_rl.rewards.base import RewardFunction, RewardInput, finite_scores

READY = "ready"


class RewardWorkerError(ValueError):
    """The child could not build the reward function (bad import path, bad option)."""


class _Child:
    """One child process and the two pipes to it."""

    def __init__(self, config, start_timeout_s: float):
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        env = dict(os.environ)
        # The child imports the user's module the way the trainer did.
        env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "megatron_rl.rewards.isolated",
                str(to_child_r),
                str(from_child_w),
            ],
            pass_fds=(to_child_r, from_child_w),
            env=env,
            stdin=subprocess.DEVNULL,
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self.send, self.recv = (
            Connection(to_child_w, readable=False),
            Connection(from_child_r, writable=False),
        )
        self.send.send(config)
        reply = self.receive(start_timeout_s)
        if reply != READY:
            self.kill()
            raise RewardWorkerError(
                f"reward function {config.display_name!r}: "
                + (reply[1] if isinstance(reply, tuple) else reply)
            )

    def receive(self, timeout_s: float | None):
        """The child's next message, or a string saying why there is none (the child is then
        killed)."""
        try:
            if self.recv.poll(timeout_s):
                return self.recv.recv()
        except (EOFError, OSError):
            code = self.proc.wait()
            return f"its worker process died (exit code {code})"
        self.kill()
        return f"RewardTimeout: took longer than {timeout_s:g} s (its worker process was killed)"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.send.close()
        self.recv.close()


class IsolatedRewardFunction(RewardFunction):
    """`config.build()`'s function, called in a killable child process with `config.timeout_s`
    per call (one sample, or one batch for batched functions)."""

    START_TIMEOUT_S = 120.0
    """For the child to import and build the function (a cold import of a big package)."""

    def __init__(self, config):
        super().__init__(config.display_name, config.timeout_s)
        self.config = config
        self.batched = bool(getattr(config, "batched", False))
        self.child: _Child | None = _Child(config, self.START_TIMEOUT_S)
        self.restarts = 0

    def _child(self) -> _Child:
        if self.child is None:
            self.child = _Child(self.config, self.START_TIMEOUT_S)
            self.restarts += 1
        return self.child

    def _replies(self, batch: list[RewardInput], expected: int) -> list[tuple]:
        """The child's `expected` replies (value, error) to `batch`: one per sample, or one
        for a batched function. A reply that does not come (time limit, the child died) is
        (None, why); the child is replaced and gets the samples not yet scored."""
        replies: list[tuple] = []
        while len(replies) < expected:
            child = self._child()
            child.send.send(batch if self.batched else batch[len(replies) :])
            while len(replies) < expected:
                reply = child.receive(self.timeout_s)
                if isinstance(reply, str):
                    self.child = None
                    child.kill()
                    replies.append((None, reply))
                    break
                replies.append(reply)
        return replies

    def __call__(self, batch: list[RewardInput]) -> tuple[list[float], list[str | None]]:
        if self.batched:
            [(value, error)] = self._replies(batch, 1)
            replies = [(v, None) for v in value] if error is None else [(None, error)] * len(batch)
        else:
            replies = self._replies(batch, len(batch))
        values = [math.nan if v is None else v for v, _ in replies]
        errors = [None if e is None else f"reward {self.name!r}: {e}" for _, e in replies]
        checked, not_finite = finite_scores(self.name, values)
        return checked, [e or n for e, n in zip(errors, not_finite, strict=True)]

    def close(self) -> None:
        if self.child is not None:
            self.child.kill()
            self.child = None


# ---------------------------------------------------------------------------- the child side


def _score(fn: RewardFunction, batch: list[RewardInput], out: Connection) -> None:
    if fn.batched:
        try:
            values = [float(v) for v in fn.score_batch(batch)]
            if len(values) != len(batch):
                raise ValueError(f"returned {len(values)} scores for {len(batch)} samples")
            out.send((values, None))
        except Exception as e:
            out.send((None, f"{type(e).__name__}: {e}"))
        return
    for sample in batch:
        try:
            out.send((float(fn.score_one(sample)), None))
        except Exception as e:
            out.send((math.nan, f"{type(e).__name__}: {e}"))


def child_main(read_fd: int, write_fd: int) -> None:
    outlive_job_signals()
    inbox, out = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    config = inbox.recv()
    try:
        fn = dataclasses.replace(config, timeout_s=None).build()
    except Exception as e:
        out.send(("error", str(e)))
        return
    out.send(READY)
    while True:
        try:
            batch = inbox.recv()
        except EOFError:  # the trainer closed the pipe: done
            return
        _score(fn, batch, out)


if __name__ == "__main__":
    child_main(int(sys.argv[1]), int(sys.argv[2]))
