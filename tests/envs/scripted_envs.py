"""Environments for the pool's tests, built by import path in its workers (`type: python`)."""

from __future__ import annotations

import os
import time

from megatron_rl.envs.base import EnvReset, StepResult


class Counter:
    """Counts its trajectory's steps in its state; done after `turns` steps."""

    def __init__(self, turns: int = 3, reward: float = 0.5):
        self.turns, self.reward = turns, reward

    def reset(self, task):
        return EnvReset(state=0, observation=f"task {task.prompt}")

    def step(self, state, action):
        state += 1
        return StepResult(
            f"step {state}: {action.text}", reward=self.reward, done=state >= self.turns,
            state=state, info={"status": "ok", "pid": os.getpid()},
        )  # fmt: skip


class Sleeper:
    """Sleeps the number of seconds its action's text says, then answers with its pid."""

    def reset(self, task):
        if task.prompt == "hang":
            time.sleep(3600)
        return EnvReset()

    def step(self, state, action):
        time.sleep(float(action.text))
        return StepResult(f"slept {action.text}", state=state, info={"pid": os.getpid()})


class Faulty:
    """Raises on "raise", exits the process on "exit"."""

    def reset(self, task):
        raise KeyError(task.prompt)

    def step(self, state, action):
        if action.text == "exit":
            os._exit(3)
        raise ValueError(f"cannot step on {action.text!r}")


class Unbuildable:
    def __init__(self):
        raise RuntimeError("no such maze")


class SlowCounter(Counter):
    """`Counter` that takes `seconds` to answer each step (a slow tool)."""

    def __init__(self, turns: int = 3, reward: float = 0.5, seconds: float = 0.3):
        super().__init__(turns, reward)
        self.seconds = seconds

    def step(self, state, action):
        time.sleep(self.seconds)
        return super().step(state, action)
