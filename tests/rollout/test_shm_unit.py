"""Shared-memory files: which are ours (from /proc/self/maps), and the clean-up of those a
killed run left behind."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
from multiprocessing import resource_tracker, shared_memory

from megatron_rl.rollout.shm import ShmRecord, mapped_shm_files, unlink_cpu_shm


def test_a_killed_runs_files_are_removed_at_the_next_start(tmp_path):
    # A "run" that maps a shared-memory file, records it, and is SIGKILLed.
    code = (
        "import sys, time\n"
        "from multiprocessing import shared_memory\n"
        "from megatron_rl.rollout.shm import ShmRecord\n"
        "from multiprocessing import resource_tracker\n"
        "m = shared_memory.SharedMemory(create=True, size=4096)\n"
        # as vLLM's readers: no resource tracker unlinks it after the kill
        "resource_tracker.unregister(m._name, 'shared_memory')\n"
        "ShmRecord(sys.argv[1], 0).write()\n"
        "print(m.name, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    name = proc.stdout.readline().strip()
    proc.kill()
    proc.wait()
    leftover = f"/dev/shm/{name}"
    assert os.path.exists(leftover)  # SIGKILL: nobody unlinked it
    other = shared_memory.SharedMemory(create=True, size=4096)  # another job's, alive
    try:
        assert ShmRecord(tmp_path, 1).remove_stale() == []  # another rank's record: none
        assert ShmRecord(tmp_path, 0).remove_stale() == [leftover]
        assert not os.path.exists(leftover)
        assert os.path.exists(f"/dev/shm/{other.name}")
        assert not (tmp_path / ".shm" / "rank0.json").exists()
    finally:
        other.close()
        other.unlink()


def test_a_live_runs_files_are_kept_and_cleaned_up_on_exit(tmp_path):
    mine = shared_memory.SharedMemory(create=True, size=4096)
    path = f"/dev/shm/{mine.name}"
    assert path in mapped_shm_files()
    record = ShmRecord(tmp_path, 0)
    record.write()
    assert json.loads(record.path.read_text())["files"] == mapped_shm_files()
    assert record.remove_stale() == [] and os.path.exists(path)  # our own pid is alive
    held = shared_memory.SharedMemory(create=True, size=4096)  # its owner still alive
    record.write()
    mine.close()  # released, not unlinked: ours to remove
    resource_tracker.unregister(mine._name, "shared_memory")  # no tracker unlinks it after us
    record.clean_up()
    assert not os.path.exists(path) and not record.path.exists()
    try:  # left to its owner, whose unlink would otherwise fail at exit
        assert os.path.exists(f"/dev/shm/{held.name}")
    finally:
        held.close()
        held.unlink()


def test_the_vllm_cpu_communicator_files_this_process_maps_are_unlinked_after_shutdown():
    def shm_file(name: str, mapped: bool):
        path = f"/dev/shm/{name}"
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)
        if not mapped:
            return path, None
        with open(path, "r+b") as f:
            return path, mmap.mmap(f.fileno(), 4096)

    tag = f"mrltest{os.getpid()}"
    ours, ours_map = shm_file(f"job1-2-{tag}-cpushm_0", mapped=True)
    other_job, _ = shm_file(f"job3-4-{tag}-cpushm_0", mapped=False)  # not mapped here
    not_vllms, not_vllms_map = shm_file(f"{tag}-queue", mapped=True)
    try:
        assert unlink_cpu_shm() == [ours]
        assert not os.path.exists(ours) and os.path.exists(other_job)
        assert os.path.exists(not_vllms)
        ours_map[0] = 1  # the mapping outlives the name
    finally:
        ours_map.close(), not_vllms_map.close()
        for path in (ours, other_job, not_vllms):
            if os.path.exists(path):
                os.unlink(path)
