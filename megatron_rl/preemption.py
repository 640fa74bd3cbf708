"""Stop requests from a scheduler: the workers save the last step boundary and exit 0.

A request is either a signal to the worker itself (SIGTERM from plain `scancel`, a
pre-emption or torchrun passing its own on, SIGUSR1) or a stop file: the path in
$MEGATRON_RL_STOP_FILE exists. The file is how the launcher (`megatron_rl.launch`) and the
sbatch script pass a request on: unlike a signal it cannot arrive before a worker has
installed its handler (a worker killed by its SIGUSR1 saves nothing), and a request made
before the workers exist at all is still there when they start.

The trainer looks for a request at its abort points (`RLTrainer.abort_point`): inside vLLM's
generation, between the rollout's chunks, after the rollout, before each role's experience
forward, before the update and once the first mini-batch's gradients are computed, before
any weight changes. Once the ranks agree that some rank saw one, every rank raises
`StepAborted` together and the trainer saves the state of the step's start. From the first
optimizer step on, the step is finished instead, and saved.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

STOP_FILE_ENV = "MEGATRON_RL_STOP_FILE"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def stop_file() -> Path | None:
    path = os.environ.get(STOP_FILE_ENV)
    return Path(path) if path else None


def request_stop(path: Path, reason: str) -> None:
    """Create the stop file (its text says why); safe to call from a signal handler."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(reason + "\n")


def plain_torchrun_warning(env=os.environ) -> str | None:
    """What a scheduler's stop does to a run that plain torchrun started (no stop file named
    by `megatron_rl.launch` or the sbatch script), or None for any other start."""
    if STOP_FILE_ENV in env or "TORCHELASTIC_RUN_ID" not in env:
        return None
    timeout = env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30")
    return (
        "warning: started by plain torchrun: a SIGTERM to torchrun reaches the workers as a "
        f"stop request, but torchrun SIGKILLs them {timeout} s later (its shutdown timeout, "
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT, unless --shutdown-timeout says otherwise; torch 2.11 "
        "always waits 30 s), and a SIGUSR1 kills torchrun itself, orphaning them. "
        "`python -m megatron_rl.launch` takes the same arguments and turns either signal into "
        "a stop request with 900 s to save"
    )


def grace_warning(what: str, seconds: float, grace_s: float | None) -> str | None:
    """A warning when `what` took too much of the scheduler's grace time (`trainer.stop_grace_s`):
    a save, more than half of it (a stop mid-step needs the abort's wait first); a whole stop
    (`what` = "this stop"), more than all of it."""
    if grace_s is None:
        return None
    limit = grace_s if what == "this stop" else grace_s / 2
    if seconds <= limit:
        return None
    share = "all" if what == "this stop" else "half"
    return (
        f"warning: {what} took {seconds:.1f} s, more than {share} of trainer.stop_grace_s="
        f"{grace_s:g}: a scheduler's SIGKILL would come first; give it a longer lead time "
        "(docs/reliability.md, 'Choosing the signal's lead time')"
    )


class StopRequest:
    """`install()` first thing in a worker; `requested` at every step boundary."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self.signal_time: float | None = None

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self.signal is None:
            self.signal_time = time.time()
        self.signal = signal.Signals(signum).name

    @property
    def since(self) -> float | None:
        """When the request was made (the signal's arrival, or the stop file's mtime), in
        `time.time()` seconds; None when there is none here."""
        if self.signal_time is not None:
            return self.signal_time
        path = stop_file()
        try:
            return path.stat().st_mtime if path is not None else None
        except FileNotFoundError:
            return None

    @property
    def reason(self) -> str | None:
        """What asked this process to stop (a signal's name, or the stop file), or None."""
        if self.signal is not None:
            return self.signal
        path = stop_file()
        if path is not None and path.exists():
            return f"stop file {path}"
        return None

    @property
    def requested(self) -> bool:
        return self.reason is not None


STOP = StopRequest()
"""This process's stop request (one per process: signal handlers are process-wide)."""


class StepAborted(Exception):
    """A stop request ended a step (before its first optimizer update, or with its updates
    rewound: `trainer.rewindable_update`). Raised on every rank together, once they agree (a
    collective), so no rank is left inside a collective."""

    def __init__(self, phase: str):
        super().__init__(f"a stop request ended the step during {phase}")
        self.phase = phase
