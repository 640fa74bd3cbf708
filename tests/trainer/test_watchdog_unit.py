"""The watchdog's report (`trainer/watchdog.py`): where a thread is, and the summary that
names the ranks that did not arrive. Firing in a real run: tests/reliability/
test_watchdog_distributed.py."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from megatron_rl.trainer.watchdog import Watchdog, summary, where


def stuck_here(release: threading.Event) -> None:
    release.wait()


def test_where_names_the_programs_innermost_frame_under_the_library_one():
    release = threading.Event()
    t = threading.Thread(target=stuck_here, args=(release,))
    t.start()
    try:
        time.sleep(0.2)
        place = where(sys._current_frames()[t.ident])
    finally:
        release.set()
        t.join()
    assert place["collective"] is None
    assert place["from"].startswith("tests/trainer/test_watchdog_unit.py:")
    assert place["from"].endswith(" stuck_here")
    assert place["at"].startswith("threading.py:")  # Event.wait: the library frame inside


def test_the_summary_groups_ranks_by_the_collective_they_wait_in():
    def report(rank, **kw):
        return {"rank": rank, "unit": "train step 2", "phase": "rollout", **kw}

    waiting = dict(at="torch/distributed/distributed_c10d.py:1 all_reduce", collective="all_reduce")
    reports = {
        0: report(0, **waiting, **{"from": "megatron_rl/parallel/collectives.py:53 data_parallel_min"}),
        2: report(2, **waiting, **{"from": "megatron_rl/parallel/collectives.py:53 data_parallel_min"}),
        1: report(1, at="vllm/x.py:9 spin", collective=None, **{"from": "megatron_rl/rollout/replica.py:1 generate"}),
        3: {"unit": "train step 2", "phase": "rollout", "since": time.time() - 50},
    }  # fmt: skip
    lines = summary(reports, world_size=5)
    assert lines[0].startswith("rank 0, train step 2 / rollout: waits in a collective (all_reduce)")
    assert lines[1] == (
        "rank 1, train step 2 / rollout: at megatron_rl/rollout/replica.py:1 generate "
        "(in vllm/x.py:9 spin)"
    )
    assert lines[3].startswith("rank 3, train step 2 / rollout since 5") and "no report" in lines[3]
    assert lines[4] == "rank 4: no report and no phase recorded"
    assert lines[5] == (
        "ranks [0, 2] wait in all_reduce from megatron_rl/parallel/collectives.py:53 "
        "data_parallel_min; ranks [1, 3, 4] did not arrive there"
    )


def test_an_error_inside_a_phase_carries_the_phase_once():
    dog = Watchdog(timeout_s=None, rank=0, world_size=1)  # no timer, no store
    with pytest.raises(RuntimeError) as raised, dog.watch("train step 7"), dog.phase("sync"):
        raise RuntimeError("Timed out waiting 30000ms for recv operation to complete")
    assert raised.value.__notes__ == ["megatron_rl watchdog: rank 0 was in train step 7 / sync"]
