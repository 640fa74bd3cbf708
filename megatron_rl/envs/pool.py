"""`EnvPool`: environment steps run in killable worker processes, each with a time limit.

Dataflow. `submit(key, request)` never blocks: the request joins a FIFO queue and goes to the
first idle worker. `poll(timeout_s)` waits (at most `timeout_s`) on the busy workers' pipes,
collects every answer that has arrived, kills the workers whose request has outlived
`step_timeout_s` (their process group, so a sandbox they started goes too: it also dies
with its parent) and starts fresh ones, hands queued requests to idle workers, and returns
the finished requests as (key, outcome). So the caller (the agent loop) keeps the engine
generating while tools run, and a tool that never answers costs its trajectory at most
`step_timeout_s`; the other trajectories' requests are untouched.

Outcomes: a `StepResult` or `EnvReset` as the environment returned it; for a step that
failed, a `StepResult` saying so (info["status"] = "timeout", "died" or "env_error", the
state from before the step kept): a timeout or a dead worker is observed by the policy
("environment did not answer within 10 s") or ends the trajectory (`on_timeout`), an
exception raised by the environment (its bug) ends it; a reset that failed gives
`EnvFailure` (the trajectory cannot start).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import wait

from megatron_rl.child_process import ChildDied, ChildProcess, ChildStartError
from megatron_rl.envs.base import StepResult


class EnvWorkerError(RuntimeError):
    """A worker could not build its environment (bad import path, bad option, no sandbox)."""


@dataclass(frozen=True)
class EnvFailure:
    """A reset that did not succeed."""

    status: str
    """"timeout", "died" or "env_error"."""
    message: str


START_TIMEOUT_S = 120.0
"""For a worker to import and build its environment (a cold import of a big package)."""


class _Worker(ChildProcess):
    """A worker process (`envs/worker.py`) and the request it is running."""

    def __init__(self, config):
        try:
            super().__init__("megatron_rl.envs.worker", config, START_TIMEOUT_S)
        except ChildStartError as e:
            why = str(e)
            if not why.startswith("environment "):
                why = f"environment {config.display_name!r}: {why}"
            raise EnvWorkerError(why) from None
        self.job: tuple | None = None  # (key, request, deadline)

    def start(self, key, request, step_timeout_s: float) -> None:
        self.send(request)
        self.job = (key, request, time.monotonic() + step_timeout_s)


class EnvPool:
    """`config.num_workers` workers of `config` (an `EnvConfig`); see the module docstring."""

    def __init__(self, config):
        self.config = config
        self.queue: deque = deque()
        self.workers: list[_Worker] = []
        self.restarts = 0
        try:
            for _ in range(config.num_workers):
                self.workers.append(_Worker(config))
        except BaseException:
            self.close()
            raise

    def submit(self, key, request: tuple) -> None:
        """Queue ("reset", task) or ("step", state, action) for trajectory `key`."""
        if request[0] not in ("reset", "step"):
            raise ValueError(f"unknown environment request {request[0]!r}")
        self.queue.append((key, request))
        self._dispatch()

    @property
    def pending(self) -> int:
        """Requests queued or running."""
        return len(self.queue) + sum(w.job is not None for w in self.workers)

    def poll(self, timeout_s: float = 0.0) -> list[tuple]:
        """The (key, outcome) of requests finished within `timeout_s` (see the module
        docstring); returns early once one has, at once when none is pending."""
        done: list[tuple] = []
        end = time.monotonic() + timeout_s
        while self.pending and not done:
            busy = [w for w in self.workers if w.job is not None]
            if not busy:  # queued requests and no worker: none was configured
                raise EnvWorkerError("environment pool has no worker (num_workers 0)")
            nearest = min(w.job[2] for w in busy)
            wait_s = max(0.0, min(end, nearest) - time.monotonic())
            for worker in wait(busy, wait_s):
                done.append(self._receive(worker))
            now = time.monotonic()
            for worker in busy:
                if worker.job is not None and now >= worker.job[2]:
                    done.append(self._fail(worker, "timeout"))
            self._dispatch()
            if now >= end:
                break
        return done

    def cancel_all(self) -> None:
        """Drop every queued request and kill the workers running one (a stop request: the
        sandboxes they started die with them); fresh workers take their place."""
        self.queue.clear()
        for i, worker in enumerate(self.workers):
            if worker.job is not None:
                worker.kill()
                self.workers[i] = self._fresh()

    def close(self) -> None:
        for worker in self.workers:
            worker.kill()
        self.workers = []

    # ---------------------------------------------------------------------- internals

    def _fresh(self) -> _Worker:
        self.restarts += 1
        return _Worker(self.config)

    def _dispatch(self) -> None:
        for worker in self.workers:
            if not self.queue:
                return
            if worker.job is None:
                key, request = self.queue.popleft()
                worker.start(key, request, self.config.step_timeout_s)

    def _receive(self, worker: _Worker) -> tuple:
        key, request, _ = worker.job
        try:
            reply = worker.receive()
        except ChildDied as e:
            return self._fail(worker, "died", e.exit_code)
        worker.job = None
        if isinstance(reply, tuple) and reply[:1] == ("error",):
            return key, self._failure(request, "env_error", reply[1])
        return key, reply

    def _fail(self, worker: _Worker, status: str, exit_code: int | None = None) -> tuple:
        """The worker's request failed (`status`; a dead worker's `exit_code`): the worker is
        replaced."""
        key, request, _ = worker.job
        worker.job = None
        worker.kill()
        self.workers[self.workers.index(worker)] = self._fresh()
        limit = self.config.step_timeout_s
        message = (
            f"environment did not answer within {limit:g} s"
            if status == "timeout"
            else f"environment worker died (exit code {exit_code})"
        )
        return key, self._failure(request, status, message)

    def _failure(self, request: tuple, status: str, message: str) -> StepResult | EnvFailure:
        if request[0] == "reset":
            return EnvFailure(status, message)
        state = request[1]
        # A timeout or a dead worker may be the tool's fault (an infinite loop), which the
        # policy can learn from: observed unless configured to end the trajectory. An
        # exception is the environment's own bug: the trajectory ends, the error reported.
        observe = status != "env_error" and self.config.on_timeout == "observe"
        return StepResult(
            observation=message if observe else None,
            done=not observe,
            state=state,
            info={"status": status, "error": message},
        )
