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
any weight changes, and before each later mini-batch (its updates then rewound:
`trainer.rewindable_update`). Once the ranks agree that some rank saw one, every rank raises
`StepAborted` together and the trainer saves the state of the step's start. A request one
process sees reaches the others through torch.distributed's store (`share_through`).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

STOP_FILE_ENV = "MEGATRON_RL_STOP_FILE"
SHARED_KEY = "megatron_rl/stop_request"
"""The key of a request published in torch.distributed's store (`StopRequest.share_through`)."""
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
    """`install()` first thing in a worker; `requested` at every step boundary and abort point.

    `share_through(store)` (once torch.distributed is up) makes a request one process sees
    visible to all: the first time `reason` finds one here (a signal only this process got,
    say: a pre-empted node's workers under plain torchrun), it writes it to the job's
    key-value store, and every other process's `reason` reads it from there at its next
    check. So a replica still generating aborts at its next check instead of finishing its
    rollout before the world agrees (the stop file does the same where every node sees it)."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self.signal_time: float | None = None
        self.store = None
        self.rank: int | None = None
        self.published = False

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self.signal is None:
            self.signal_time = time.time()
        self.signal = signal.Signals(signum).name

    def share_through(self, store, rank: int) -> None:
        """Publish and read requests through `store` (torch.distributed's, rank `rank`)."""
        self.store, self.rank, self.published = store, rank, False

    def _local(self) -> tuple[str, float | None] | None:
        """(reason, since) of a request made to this process itself, or None."""
        if self.signal is not None:
            return self.signal, self.signal_time
        path = stop_file()
        if path is None:
            return None
        try:
            return f"stop file {path}", path.stat().st_mtime
        except FileNotFoundError:
            return None

    def _publish(self, local: tuple[str, float | None]) -> None:
        if self.store is None or self.published:
            return
        reason, since = local
        self.store.set(
            SHARED_KEY, json.dumps({"reason": f"{reason} on rank {self.rank}", "since": since})
        )
        # TCPStore's set does not wait for the server; a wait on the same connection returns
        # once the set is applied, so every later check anywhere sees it
        self.store.wait([SHARED_KEY])
        self.published = True

    def _shared(self) -> tuple[str, float | None] | None:
        """The request some process published, or None. Store calls are made here, in the
        main thread at a check, never in the signal handler."""
        if self.store is None or not self.store.check([SHARED_KEY]):
            return None
        record = json.loads(self.store.get(SHARED_KEY))
        return record["reason"], record["since"]

    def _found(self) -> tuple[str, float | None] | None:
        """(reason, since) of the request this process obeys: its own (published the first
        time it is seen), else one another process published, else None."""
        local = self._local()
        if local is not None:
            self._publish(local)
            return local
        return self._shared()

    @property
    def since(self) -> float | None:
        """When the request was made (the signal's arrival, or the stop file's mtime), in
        `time.time()` seconds; None when there is none."""
        found = self._found()
        return found[1] if found else None

    @property
    def reason(self) -> str | None:
        """What asked this process to stop (a signal's name, the stop file, or a request
        another rank published: "SIGTERM on rank 3"), or None."""
        found = self._found()
        return found[0] if found else None

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
