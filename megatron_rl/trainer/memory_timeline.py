"""Peak memory of each phase of a step, with the rollout engine's state in it.

A colocated step swaps memory between vLLM and Megatron; the out-of-memory a 32B run hits
is the peak of one phase. Each phase records:
- on GPU: torch's peak allocated bytes in the phase and the device memory in use at its
  end (vLLM's sleep-mode pool is outside torch's counters; `mem_get_info` sees it);
- on CPU: the process's peak resident set in the phase (Linux VmHWM, reset at the phase's
  start through /proc/self/clear_refs; where that is not allowed, the resident set at the
  phase's end).
Rank 0 appends one row per phase to output_dir/memory_timeline.jsonl, and the step's metrics
get `memory/<phase>_peak_gib`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch

GIB = 1024**3


def _proc_status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    """Start a new peak: torch's counter on GPU, VmHWM on Linux (True if it was reset)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        return True
    try:
        Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def _peak_bytes(reset_worked: bool) -> dict[str, float]:
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        return {
            "peak_gib": torch.cuda.max_memory_allocated() / GIB,
            "device_used_gib": (total - free) / GIB,
        }
    kib = _proc_status_kib("VmHWM" if reset_worked else "VmRSS")
    return {"peak_gib": (kib or 0) * 1024 / GIB}


class MemoryTimeline:
    def __init__(self, path: Path | None, engine_state: Callable[[], str]):
        """`path`: the jsonl file rank 0 appends to (None on other ranks);
        `engine_state`: what the rollout engine holds now, e.g. "weights+kv_cache"."""
        self.path, self.engine_state = path, engine_state
        self.rows: list[dict] = []

    @contextmanager
    def phase(self, name: str):
        reset_worked = _reset_peak()
        start = time.perf_counter()
        state = self.engine_state()
        yield
        self.rows.append(
            {
                "phase": name,
                "engine": state,
                "seconds": time.perf_counter() - start,
                **_peak_bytes(reset_worked),
            }
        )

    def end_step(self, step: int, stage: str) -> dict[str, float]:
        """The step's `memory/<phase>_peak_gib` metrics; rank 0 writes the step's rows."""
        rows, self.rows = self.rows, []
        if self.path is not None and rows:
            with self.path.open("a") as f:
                for row in rows:
                    f.write(json.dumps({"stage": stage, "step": step, **row}) + "\n")
        return {f"memory/{r['phase']}_peak_gib": r["peak_gib"] for r in rows}
