"""Stop requests from a scheduler: the workers finish the step, save and exit 0.

A request is either a signal to the worker itself (SIGTERM from plain `scancel` or a
pre-emption, SIGUSR1) or a stop file: the path in $MEGATRON_RL_STOP_FILE exists. The file is
how the launcher (`megatron_rl.launch`) and the sbatch script pass a request on: unlike a
signal it cannot arrive before a worker has installed its handler (a worker killed by its
SIGUSR1 saves nothing), and a request made before the workers exist at all is still there
when they start. Workers look for it at step boundaries, where they look at the signal flag.
"""

from __future__ import annotations

import os
import signal
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


class StopRequest:
    """`install()` first thing in a worker; `requested` at every step boundary."""

    def __init__(self) -> None:
        self.signal: str | None = None

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.signal = signal.Signals(signum).name

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
