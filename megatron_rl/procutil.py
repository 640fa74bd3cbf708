"""Helper processes of a rank (reward workers, the checkpoint writer's queue manager), and the
process-level facts every launcher shares (a free port, the thread-count variables)."""

from __future__ import annotations

import ctypes
import signal
import socket

THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
"""The thread-count variables of OpenMP, MKL and OpenBLAS, read by child processes."""

JOB_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def outlive_job_signals() -> None:
    """Call first thing in a helper process. SLURM's `scancel` (and pre-emption) signals every
    process of the job; the rank finishes its step and saves, and needs its helpers until
    then, so they ignore those signals. They die with their parent instead (Linux
    PR_SET_PDEATHSIG: SIGKILL when the rank exits, even while stuck in C code)."""
    for sig in JOB_STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: no parent-death signal
        pass


def free_port() -> int:
    """A TCP port free on this host now (the kernel's pick), for a rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
