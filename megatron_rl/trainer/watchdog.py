"""No hang is silent: a watchdog over each step of a run, and the phase on every error.

A rank arms the watchdog for a unit of work (`watch("train step 3")`: the step with its
evaluation and save) and names the phase it enters (`phase("rollout")`); each phase is also
recorded in the torchrun store, which every rank of the job can read.

Dataflow when a unit outlives `trainer.step_timeout_s` on a rank: its watchdog thread looks
at where the main thread is (the innermost frame, and the collective it waits in if any),
puts that report in the store, waits up to `REPORT_WAIT_S` for the other ranks' reports
(their watchdogs fire at about the same time), and the lowest rank that reported prints every
rank's place, grouped: ranks waiting in a collective, and the ranks elsewhere that did not
arrive there. Then the rank exits (`WATCHDOG_EXIT_CODE`) and torchrun stops the rest.

A rank whose interpreter is held by native code (a kernel or a spin that never releases the
GIL) cannot run the thread: `faulthandler`, a C thread, dumps its stacks and ends it
`NATIVE_GRACE_S` later. A collective that times out first (`parallel.
distributed_timeout_minutes`) raises on its rank; `phase` adds a note to that error with the
rank's phase and the other ranks' last recorded phases.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import sysconfig
import threading
import time
import traceback
from contextlib import contextmanager

WATCHDOG_EXIT_CODE = 3
REPORT_WAIT_S = 10.0
"""How long a firing rank waits for the other ranks' reports."""
NATIVE_GRACE_S = 60.0
"""After the timeout, when faulthandler ends a rank whose watchdog thread could not run."""
PHASE_KEY, REPORT_KEY = "megatron_rl/phase/{}", "megatron_rl/watchdog/{}"
NOTE = "megatron_rl watchdog:"
BETWEEN = "between phases"


def default_store():
    """The torchrun job's key-value store (the one the process group was made from), or None."""
    # torch only here: the watchdog itself (and its unit tests) run without it
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def _short(path: str) -> str:
    for marker in ("site-packages/", os.getcwd() + "/", sysconfig.get_paths()["stdlib"] + "/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def _library(path: str) -> bool:
    return "site-packages/" in path or path.startswith((sysconfig.get_paths()["stdlib"], "<"))


def where(frame) -> dict:
    """Where a thread is, from its innermost `frame`: {"at": the innermost frame, "from":
    the innermost frame of the program (megatron_rl or the user's, not a library), and
    "collective": the torch.distributed call it waits in, or None}."""
    stack = traceback.extract_stack(frame) if frame is not None else []
    if not stack:
        return {"at": "?", "from": "?", "collective": None}

    def show(f):
        return f"{_short(f.filename)}:{f.lineno} {f.name}"

    program = [f for f in stack if not _library(f.filename)]
    collective = None
    if "torch/distributed/" in stack[-1].filename:
        # the outermost torch.distributed frame is the call the program made (all_reduce, ...)
        collective = next(
            f.name for f in stack if "torch/distributed/" in f.filename and f.name != "wrapper"
        )
    return {
        "at": show(stack[-1]),
        "from": show(program[-1]) if program else show(stack[-1]),
        "collective": collective,
    }


def describe(report: dict) -> str:
    if report.get("collective"):
        place = f"waits in a collective ({report['collective']}) called from {report['from']}"
    else:
        inner = f" (in {report['at']})" if report["at"] != report["from"] else ""
        place = f"at {report['from']}{inner}"
    return f"rank {report['rank']}, {report['unit']} / {report['phase']}: {place}"


def summary(reports: dict[int, dict], world_size: int) -> list[str]:
    """Lines for every rank: its place (or its last recorded phase), then which ranks did
    not arrive where others wait."""
    lines = []
    for rank in range(world_size):
        r = reports.get(rank)
        if r is None:
            lines.append(f"rank {rank}: no report and no phase recorded")
        elif "at" in r:
            lines.append(describe(r))
        else:
            lines.append(
                f"rank {rank}, {r['unit']} / {r['phase']} since {time.time() - r['since']:.0f} s: "
                "no report (its interpreter may be held by native code)"
            )
    waiting: dict[str, list[int]] = {}
    for rank, r in sorted(reports.items()):
        if r.get("collective"):
            waiting.setdefault(f"{r['collective']} from {r['from']}", []).append(rank)
    for place, ranks in waiting.items():
        others = [r for r in range(world_size) if r not in ranks]
        lines.append(f"ranks {ranks} wait in {place}; ranks {others} did not arrive there")
    return lines


class Watchdog:
    def __init__(self, *, timeout_s: float | None, rank: int, world_size: int, store=None):
        self.timeout_s, self.rank, self.world_size, self.store = timeout_s, rank, world_size, store
        self.unit, self.current, self.armed_at = "start-up", BETWEEN, None
        self._main = threading.get_ident()
        if timeout_s:
            threading.Thread(target=self._run, daemon=True, name="megatron_rl-watchdog").start()

    # ------------------------------------------------------------------ the main thread's side

    @contextmanager
    def watch(self, unit: str):
        """Arm for `unit` (e.g. "train step 3"); disarmed when it ends."""
        self.unit, self.armed_at = unit, time.monotonic()
        if self.timeout_s:
            faulthandler.dump_traceback_later(self.timeout_s + NATIVE_GRACE_S, exit=True)
        try:
            with self.phase(BETWEEN):
                yield
        finally:
            self.armed_at = None
            if self.timeout_s:
                faulthandler.cancel_dump_traceback_later()

    @contextmanager
    def phase(self, name: str):
        """Name what this rank does now; an error raised inside gets a note naming it and
        the other ranks' last phases."""
        previous, self.current = self.current, name
        self._record()
        try:
            yield
        except Exception as e:
            if not any(n.startswith(NOTE) for n in getattr(e, "__notes__", [])):
                e.add_note(self._note())
            raise
        finally:
            self.current = previous

    def _record(self) -> None:
        self._put(PHASE_KEY, {"unit": self.unit, "phase": self.current, "since": time.time()})

    def _note(self) -> str:
        others = {r: v for r, v in self._read(PHASE_KEY).items() if r != self.rank}
        lines = [f"{NOTE} rank {self.rank} was in {self.unit} / {self.current}"]
        lines += [
            f"  rank {r} last entered {v['unit']} / {v['phase']} "
            f"{time.time() - v['since']:.0f} s ago"
            for r, v in sorted(others.items())
        ]
        return "\n".join(lines)

    # ------------------------------------------------------------------ the store

    def _put(self, key: str, value: dict) -> None:
        if self.store is None:
            return
        try:
            self.store.set(key.format(self.rank), json.dumps(value))
        except Exception:  # noqa: BLE001 - the store's host may be gone: report without it
            self.store = None

    def _read(self, key: str) -> dict[int, dict]:
        out = {}
        if self.store is None:
            return out
        for rank in range(self.world_size):
            name = key.format(rank)
            try:
                if self.store.check([name]):
                    out[rank] = json.loads(self.store.get(name))
            except Exception:  # noqa: BLE001 - as in _put
                break
        return out

    # ------------------------------------------------------------------ the watchdog thread

    def _run(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout_s / 10))
            armed = self.armed_at
            if armed is not None and time.monotonic() - armed > self.timeout_s:
                self._fire(time.monotonic() - armed)

    def _fire(self, elapsed: float) -> None:
        frame = sys._current_frames().get(self._main)
        mine = {"rank": self.rank, "unit": self.unit, "phase": self.current, **where(frame)}
        self._put(REPORT_KEY, mine)
        deadline = time.monotonic() + REPORT_WAIT_S
        reports = self._read(REPORT_KEY)
        while len(reports) < self.world_size and time.monotonic() < deadline:
            time.sleep(0.5)
            reports = self._read(REPORT_KEY)
        reports[self.rank] = mine
        if min(reports) == self.rank:  # one rank prints the whole picture
            known = {**self._read(PHASE_KEY), **reports}  # a phase where no report came
            head = (
                f"watchdog: {self.unit} ran {elapsed:.0f} s on rank {self.rank}, over "
                f"trainer.step_timeout_s={self.timeout_s:g}: ending the run. Where each rank is:"
            )
            print("\n  ".join([head, *summary(known, self.world_size)]), file=sys.stderr)
        else:
            print(f"watchdog: {describe(mine)}; ending the run", file=sys.stderr)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(WATCHDOG_EXIT_CODE)
