"""Launch training under torchrun: a pre-emption-safe front for clusters, and a runner with a
hard time limit for the tests and the demo.

    python -m megatron_rl.launch [torchrun options] -m megatron_rl.cli.train --config C [k=v ...]

runs torchrun with the same arguments, but a SIGTERM or SIGUSR1 sent to this launcher (a
container runtime's stop, SLURM's `--signal=B:...`, `kill`) becomes a stop request to the
training workers (`megatron_rl.preemption`: a stop file, not a signal, so a worker still
starting up cannot die of it): they save the last step boundary and exit 0, so
torchrun and this launcher exit 0 too. torchrun signalled itself would stop its workers
with a SIGKILL after its shutdown timeout (30 s by default) and exit 1; here that timeout
defaults to `SHUTDOWN_TIMEOUT_S` (`TORCH_ELASTIC_SHUTDOWN_TIMEOUT` in torchrun's environment,
unless it is set or `--shutdown-timeout` is given), so a scheduler that signals every
process still leaves time to save. torch 2.11 has no such setting (its torchrun refuses
`--shutdown-timeout` and waits 30 s: seen on the GPU machine, bench/gpu.md), which is why it
travels in the environment: such versions ignore it instead of failing.

`run_torchrun` is used by the tests and the demo. On a timeout the whole process tree is
killed: torchrun starts each worker in a session of its own, so killing torchrun's process
group alone would orphan hung ranks (and their open stdout would block us forever). On
failure the error carries torchrun's output, which includes the failing rank's traceback
(workers decorate their entry with
`torch.distributed.elastic.multiprocessing.errors.record`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from megatron_rl.preemption import STOP_FILE_ENV, STOP_SIGNALS, request_stop, stop_file
from megatron_rl.procutil import THREAD_ENV_VARS, free_port

SHUTDOWN_TIMEOUT_S = 900
"""torchrun's wait between SIGTERM and SIGKILL of its workers: a step and a save of a large run."""
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
"""Read by torchrun (torch 2.13; not 2.11) when `--shutdown-timeout` is not given (torch/distributed/launcher/api.py)."""


class TorchrunError(RuntimeError):
    """A torchrun job failed or timed out; the message holds the end of its output."""


@dataclass(frozen=True)
class TorchrunResult:
    returncode: int
    output: str


def _tail(text: str, chars: int = 12000) -> str:
    return text if len(text) <= chars else "...\n" + text[-chars:]


def kill_tree(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM torchrun (it forwards to its workers), then SIGKILL whatever is left."""

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


RANKS_AS_NODES_ENV = "MEGATRON_RL_RANKS_AS_NODES"
"""Set to 1: `run_torchrun` starts each rank as a one-process torchrun node of its own, so
that ranks can share one GPU under NCCL (`rank_node_commands`)."""


def rank_node_commands(nproc: int, port: int, job: Sequence[str]) -> list[tuple[list[str], dict]]:
    """(argv, extra environment) of `nproc` one-process torchrun nodes on this host, one per
    rank, `job` (`-m module args` or `script args`) in each: every rank has LOCAL_RANK 0.

    Why: NCCL refuses two ranks of one host on one device ("Duplicate GPU detected"); with a
    `NCCL_HOSTID` of its own each rank is a host apart to NCCL, joined to the others through
    the socket transport on loopback (slow, but every collective is NCCL's own kernel; seen
    working on an H100, bench/gpu.md). Without CUDA the NCCL variables are unread."""
    return [
        (
            [
                sys.executable, "-m", "torch.distributed.run", f"--nnodes={nproc}",
                f"--node-rank={i}", "--nproc-per-node=1", "--master-addr=127.0.0.1",
                f"--master-port={port}", *job,
            ],
            {"NCCL_HOSTID": f"megatron_rl-node-{i}", "NCCL_P2P_DISABLE": "1",
             "NCCL_SHM_DISABLE": "1"},
        )
        for i in range(nproc)
    ]  # fmt: skip


def run_nodes(
    nodes: list[tuple[list[str], dict]], env: dict, timeout: float, stdout=None, cwd=None
) -> int | None:
    """Start every node, wait for all: the first non-zero exit code (the others ended), 0,
    or None when `timeout` seconds passed (all ended). Output to `stdout` (a file)."""
    procs = [
        subprocess.Popen(
            argv, env={**env, **extra}, stdout=stdout, stderr=subprocess.STDOUT, cwd=cwd,
            start_new_session=True,
        )
        for argv, extra in nodes
    ]  # fmt: skip
    deadline = time.monotonic() + timeout
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = next((c for c in codes if c not in (None, 0)), None)
            if failed is not None or all(c == 0 for c in codes):
                return failed or 0
            if time.monotonic() > deadline:
                return None
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p)
                p.wait()


PORT_TRIES = 3
"""Launches of one job when the rendezvous port was taken between `free_port` and torchrun's
bind (a race with any process on the host: seen once in 79 on the GPU machine, bench/gpu.md)."""


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
    """Run `python -m torch.distributed.run --nproc-per-node=nproc [-m] target args...`, or
    with RANKS_AS_NODES_ENV=1 a one-process torchrun node per rank (`rank_node_commands`).

    Raises TorchrunError when the job exits non-zero or outlives `timeout` seconds. A launch
    whose rendezvous lost its port to another process (no worker started) is retried on a
    fresh port, at most PORT_TRIES launches in all.
    """
    job = [*(["-m", target] if module else [target]), *args]
    full_env = {
        **os.environ,
        # One intra-op thread per rank unless told otherwise: more ranks than cores thrash
        # on 2-core CI, and a fixed count keeps CPU reductions the same on every machine.
        **{name: os.environ.get(name, "1") for name in THREAD_ENV_VARS},
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    as_nodes = os.environ.get(RANKS_AS_NODES_ENV) == "1"
    for _ in range(PORT_TRIES):
        if as_nodes:
            nodes = rank_node_commands(nproc, free_port(), job)
        else:
            nodes = [(_local_command(nproc, free_port(), job), {})]
        with tempfile.TemporaryFile("w+") as out:
            code = run_nodes(nodes, full_env, timeout, out, cwd)
            out.seek(0)
            output = out.read()
        if not (code and lost_port_race(output)):
            break
    if echo:
        print(output, end="")
    what = f"torchrun {target}" + (" (a node per rank)" if as_nodes else "")
    if code is None:
        raise TorchrunError(
            f"{what} timed out after {timeout:.0f}s and was killed; output:\n" + _tail(output)
        )
    if code != 0:
        raise TorchrunError(f"{what} exited with {code}; output:\n" + _tail(output))
    return TorchrunResult(code, output)


def _local_command(nproc: int, port: int, job: Sequence[str]) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
        "--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={port}", *job,
    ]  # fmt: skip


def lost_port_race(output: str) -> bool:
    """Whether torchrun's output is its rendezvous failing to bind its port (EADDRINUSE in
    the agent's `next_rendezvous`, before any worker starts): a launch safe to repeat."""
    return "EADDRINUSE" in output and "next_rendezvous" in output


def main(argv: Sequence[str] | None = None) -> int:
    """torchrun with `argv`; a SIGTERM / SIGUSR1 to this launcher asks the workers to stop
    (the stop file of `megatron_rl.preemption`). Returns torchrun's exit code."""
    path = stop_file()
    own = path is None  # the sbatch script names one (it may exist already); else ours
    if own:
        path = Path(tempfile.gettempdir()) / f"megatron_rl-stop-{os.getpid()}"
        path.unlink(missing_ok=True)

    def on_signal(signum, frame):
        name = signal.Signals(signum).name
        request_stop(path, f"{name} to the launcher")
        print(f"launcher: {name}: the workers save and stop ({path})", flush=True)

    for sig in STOP_SIGNALS:  # first, so that no signal from now on is lost
        signal.signal(sig, on_signal)
    args = list(sys.argv[1:] if argv is None else argv)
    env = {**os.environ, STOP_FILE_ENV: str(path)}
    env.setdefault(SHUTDOWN_TIMEOUT_ENV, str(SHUTDOWN_TIMEOUT_S))
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args], env=env)
    try:
        while True:
            try:
                return proc.wait()
            except KeyboardInterrupt:  # Ctrl-C reached torchrun too: let it stop its workers
                continue
    finally:
        if own:
            path.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
