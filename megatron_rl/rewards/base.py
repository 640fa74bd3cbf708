"""What a reward function sees, how it is called, and how its failures are contained.

A reward function scores a batch of `RewardInput`s. Per-sample functions (rules, user
functions) are called once per sample under a time limit; batched ones (reward models, remote
services) once per batch. A call that raises, times out or returns NaN/inf is a *failure*: it
is reported, not raised, so one bad sample does not kill a run (the scorer gives it the
configured failure reward and counts it).
"""

from __future__ import annotations

import math
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # an annotation only: the killable reward worker need not import torch
    from megatron_rl.data.templates import Messages


@dataclass
class RewardInput:
    prompt: str | Messages
    """The prompt as in the dataset (reward models re-template it their own way)."""
    prompt_text: str
    """The prompt as the actor saw it (its chat template applied)."""
    response: str
    """The decoded response, special tokens removed."""
    label: Any = None
    finish_reason: str = "stop"


class RewardTimeout(BaseException):
    """A BaseException, so that user code's `except Exception` cannot swallow the alarm."""


def call_with_time_limit(fn: Callable[[], Any], seconds: float | None) -> Any:
    """Run `fn()`, raising RewardTimeout after `seconds`.

    In the main thread SIGALRM interrupts the call (Python code; a C call that holds the GIL
    is interrupted only when it returns: functions that may hang there run in a killable
    process, `megatron_rl.rewards.isolated`). Elsewhere the call runs in a daemon thread that is
    abandoned on timeout: the caller moves on, the thread finishes in the background.
    """
    if seconds is None:
        return fn()
    if threading.current_thread() is threading.main_thread():

        def on_alarm(signum, frame):
            raise RewardTimeout(f"took longer than {seconds:g} s")

        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            return fn()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    box: dict[str, Any] = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised in the caller
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        raise RewardTimeout(f"took longer than {seconds:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


class RewardFunction:
    """Base class: override `score_one` (per sample) or `score_batch` (whole batch)."""

    batched = False

    def __init__(self, name: str, timeout_s: float | None = None):
        self.name = name
        self.timeout_s = timeout_s

    def score_one(self, sample: RewardInput) -> float:
        raise NotImplementedError

    def score_batch(self, batch: list[RewardInput]) -> list[float]:
        raise NotImplementedError

    def __call__(self, batch: list[RewardInput]) -> tuple[list[float], list[str | None]]:
        """(score of each sample, NaN where it failed; error message of each, or None)."""
        if self.batched:
            try:
                values = call_with_time_limit(lambda: self.score_batch(batch), self.timeout_s)
                values = [float(v) for v in values]
                if len(values) != len(batch):
                    raise ValueError(f"returned {len(values)} scores for {len(batch)} samples")
            except (Exception, RewardTimeout) as e:
                msg = f"reward {self.name!r}: {type(e).__name__}: {e}"
                return [math.nan] * len(batch), [msg] * len(batch)
            return finite_scores(self.name, values)
        values, errors = [], []
        for sample in batch:
            try:
                values.append(
                    float(call_with_time_limit(lambda s=sample: self.score_one(s), self.timeout_s))
                )
            except (Exception, RewardTimeout) as e:
                values.append(math.nan)
                errors.append(f"reward {self.name!r}: {type(e).__name__}: {e}")
                continue
            errors.append(None)
        checked, not_finite = finite_scores(self.name, values)
        return checked, [e or n for e, n in zip(errors, not_finite, strict=True)]

    def close(self) -> None:
        """Release what the function holds (a worker process, a connection)."""


def finite_scores(name: str, values: list[float]) -> tuple[list[float], list[str | None]]:
    errors = [None if math.isfinite(v) else f"reward {name!r}: returned {v}" for v in values]
    return [v if math.isfinite(v) else math.nan for v in values], errors
