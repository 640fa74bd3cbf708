"""Helper processes of a rank (reward workers, environment workers), the
process-level facts every launcher shares (a free port, the thread-count variables), and a
finished rank's quick exit."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import socket
import sys
from typing import NoReturn

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


def exit_now(code: int = 0) -> NoReturn:
    """End a finished process at once: its atexit handlers run (multiprocessing's joins,
    logging's flush), stdout and stderr are flushed, and the interpreter's finalisation is
    skipped. Why: tearing down the modules of torch, megatron-core and vLLM took 1.5 s in
    a process that had only imported them and 4.4 s in each rank of a finished tiny run
    (2-core CPU), and does nothing a finished rank needs: its files are closed, its process
    groups destroyed, its helper processes die with it (`outlive_job_signals`). Only for a
    process ending normally: an exception should leave the usual way, traceback and all."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken pipe: nothing to flush into
            stream.flush()
    os._exit(code)
