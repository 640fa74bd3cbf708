"""Launch training under torchrun: a pre-emption-safe front for clusters, and a runner with a
hard time limit for the tests and the demo.

    python -m megatron_rl.launch [torchrun options] -m megatron_rl.cli.train --config C [k=v ...]

runs torchrun with the same arguments, but a SIGTERM or SIGUSR1 sent to this launcher (a
container runtime's stop, SLURM's `--signal=B:...`, `kill`) goes to the training workers
only: they finish the step, save a checkpoint and exit 0, so torchrun and this launcher
exit 0 too. torchrun signalled itself would stop its workers with a SIGKILL after its
shutdown timeout (30 s by default) and exit 1; its `--shutdown-timeout` defaults here to
`SHUTDOWN_TIMEOUT_S`, so a scheduler that signals every process still leaves time to save.

`run_torchrun` is used by the tests and the demo. On a timeout the whole process tree is killed: torchrun
starts each worker in a session of its own, so killing torchrun's process group alone would
orphan hung ranks (and their open stdout would block us forever). On failure the error
carries torchrun's output, which includes the failing rank's traceback (workers decorate
their entry with `torch.distributed.elastic.multiprocessing.errors.record`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

SHUTDOWN_TIMEOUT_S = 900
"""torchrun's wait between SIGTERM and SIGKILL of its workers: a step and a save of a large run."""
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
"""The thread-count variables of OpenMP, MKL and OpenBLAS, read by child processes."""


class TorchrunError(RuntimeError):
    """A torchrun job failed or timed out; the message holds the end of its output."""


@dataclass(frozen=True)
class TorchrunResult:
    returncode: int
    output: str


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(text: str, chars: int = 12000) -> str:
    return text if len(text) <= chars else "...\n" + text[-chars:]


def kill_tree(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM torchrun (it forwards to its workers), then SIGKILL whatever is left."""
    import psutil

    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    for p in family:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_torchrun(
    target: str,
    args: Sequence[str] = (),
    *,
    nproc: int = 2,
    timeout: float = 600,
    module: bool = True,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    echo: bool = False,
) -> TorchrunResult:
    """Run `python -m torch.distributed.run --nproc-per-node=nproc [-m] target args...`.

    Raises TorchrunError when the job exits non-zero or outlives `timeout` seconds.
    """
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--nnodes=1",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
    ]
    cmd += ["-m", target] if module else [target]
    cmd += list(args)
    full_env = {
        **os.environ,
        # One intra-op thread per rank unless told otherwise: more ranks than cores thrash
        # on 2-core CI, and a fixed count keeps CPU reductions the same on every machine.
        **{name: os.environ.get(name, "1") for name in THREAD_ENV_VARS},
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full_env,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        output, _ = proc.communicate()
        raise TorchrunError(
            f"torchrun {target} timed out after {timeout:.0f}s and was killed; output:\n"
            + _tail(output or "")
        ) from None
    if echo:
        print(output, end="")
    if proc.returncode != 0:
        raise TorchrunError(
            f"torchrun {target} exited with {proc.returncode}; output:\n" + _tail(output)
        )
    return TorchrunResult(proc.returncode, output)


def main(argv: Sequence[str] | None = None) -> int:
    """torchrun with `argv`; SIGTERM / SIGUSR1 forwarded to its workers only. Returns
    torchrun's exit code."""
    import psutil

    args = list(sys.argv[1:] if argv is None else argv)
    if not any(a.startswith(("--shutdown-timeout", "--shutdown_timeout")) for a in args):
        args.insert(0, f"--shutdown-timeout={SHUTDOWN_TIMEOUT_S}")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args])

    def to_workers(signum, frame):
        try:
            workers = psutil.Process(proc.pid).children()  # torchrun's children are the ranks
        except psutil.NoSuchProcess:
            return
        print(f"launcher: {signal.Signals(signum).name} -> {len(workers)} worker(s)", flush=True)
        for w in workers:
            try:
                w.send_signal(signum)
            except psutil.NoSuchProcess:
                pass

    for sig in PREEMPTION_SIGNALS:
        signal.signal(sig, to_workers)
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:  # Ctrl-C reached torchrun too: let it stop its workers
            continue


if __name__ == "__main__":
    sys.exit(main())
