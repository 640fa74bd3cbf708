"""Helper processes of a rank (reward workers, the checkpoint writer's queue manager)."""

from __future__ import annotations

import signal

JOB_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def outlive_job_signals() -> None:
    """Call first thing in a helper process. SLURM's `scancel` (and pre-emption) signals every
    process of the job; the rank finishes its step and saves, and needs its helpers until
    then, so they ignore those signals. They die with their parent instead (Linux
    PR_SET_PDEATHSIG: SIGKILL when the rank exits, even while stuck in C code)."""
    import ctypes

    for sig in JOB_STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: no parent-death signal
        pass
