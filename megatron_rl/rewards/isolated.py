"""Reward functions run in a child process that is killed when a call outlives its time limit.

A time limit inside the trainer's process cannot stop a reward function stuck in C code that
holds the GIL (a catastrophic regular expression, a solver): SIGALRM is only handled between
bytecodes, and a thread cannot be killed. So user (`python`) and `math` functions with a
`timeout_s` run in a child process: the trainer sends it a batch, the child streams back one
result per sample (one per batch for batched functions), and a result that does not arrive in
time gets the child SIGKILLed (with its process group) and restarted; that sample (or batch)
counts as a failure and the rest of the batch goes to the new child. A child that dies
(segfault, `os._exit`) is a failure of the sample it was scoring, not of the run. A stop
request (`megatron_rl.preemption`) kills the child within `CANCEL_POLL_S` and raises
`StepAborted("rollout/score")`: a slow call never holds a stop longer than that.

The child is a `child_process.ChildProcess` running `python -m megatron_rl.rewards.isolated`,
not a fork of the trainer; it builds the function from its config, so import errors still
surface when the scorer is built, before any model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

from megatron_rl.child_process import (
    ChildCancelled,
    ChildDied,
    ChildProcess,
    ChildStartError,
    ChildTimeout,
    serve,
)
from megatron_rl.preemption import STOP, StepAborted
from megatron_rl.rewards.base import RewardFunction, RewardInput, finite_scores


class RewardWorkerError(ValueError):
    """The child could not build the reward function (bad import path, bad option)."""


class IsolatedRewardFunction(RewardFunction):
    """`config.build()`'s function, called in a killable child process with `config.timeout_s`
    per call (one sample, or one batch for batched functions)."""

    START_TIMEOUT_S = 120.0
    """For the child to import and build the function (a cold import of a big package)."""

    def __init__(self, config):
        super().__init__(config.display_name, config.timeout_s)
        self.config = config
        self.batched = bool(getattr(config, "batched", False))
        self.child: ChildProcess | None = self._start()
        self.restarts = 0

    def _start(self) -> ChildProcess:
        try:
            return ChildProcess("megatron_rl.rewards.isolated", self.config, self.START_TIMEOUT_S)
        except ChildStartError as e:
            raise RewardWorkerError(f"reward function {self.name!r}: {e}") from None

    def _child(self) -> ChildProcess:
        if self.child is None:
            self.child = self._start()
            self.restarts += 1
        return self.child

    def _replies(self, batch: list[RewardInput], expected: int) -> list[tuple]:
        """The child's `expected` replies (value, error) to `batch`: one per sample, or one
        for a batched function. A reply that does not come (time limit, the child died) is
        (None, why); the child is replaced and gets the samples not yet scored."""
        replies: list[tuple] = []
        while len(replies) < expected:
            child = self._child()
            child.send(batch if self.batched else batch[len(replies) :])
            while len(replies) < expected:
                try:
                    replies.append(child.receive(self.timeout_s, cancel=lambda: STOP.requested))
                    continue
                except ChildCancelled:  # a stop request: the step aborts, its calls with it
                    self.child = None
                    raise StepAborted("rollout/score") from None
                except ChildTimeout:
                    limit = f"{self.timeout_s:g} s"
                    why = f"RewardTimeout: took longer than {limit} (its worker process was killed)"
                except ChildDied as e:
                    why = f"its worker process died (exit code {e.exit_code})"
                self.child = None  # killed and reaped: the next samples go to a fresh child
                replies.append((None, why))
                break
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


def _build(config) -> RewardFunction:
    # The parent enforces the time limit by killing this process: no limit inside it.
    return dataclasses.replace(config, timeout_s=None).build()


def _score(fn: RewardFunction, batch: list[RewardInput]) -> Iterator[tuple]:
    """The replies to `batch`: (values, error) for a batched function, else (value, error)
    per sample, each yielded (so sent) as soon as it is scored."""
    if fn.batched:
        try:
            values = [float(v) for v in fn.score_batch(batch)]
            if len(values) != len(batch):
                raise ValueError(f"returned {len(values)} scores for {len(batch)} samples")
            reply = (values, None)
        except Exception as e:
            reply = (None, f"{type(e).__name__}: {e}")
        yield reply
        return
    for sample in batch:
        try:
            reply = (float(fn.score_one(sample)), None)
        except Exception as e:
            reply = (math.nan, f"{type(e).__name__}: {e}")
        yield reply


if __name__ == "__main__":
    serve(_build, _score)
