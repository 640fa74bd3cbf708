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

Hand-offs: before the rollout engine wakes, `release_cached_blocks` gives the blocks PyTorch's
caching allocator keeps back to the driver, and on GPU records a row {"hand_off": before,
"reserved_gib_before", "reserved_gib_after"} (metric `memory/<before>_released_gib`). On CPU
there is no such cache (vLLM's KV cache is its own host memory): no call, no row.
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


def release_cached_blocks() -> tuple[int, int] | None:
    """Give the blocks PyTorch's CUDA allocator caches back to the driver; (reserved bytes
    before, after), or None without CUDA.

    Why: vLLM's sleep-mode pool (its weights and KV cache) is mapped with the CUDA driver's
    own calls, outside PyTorch's allocator, and it sizes the KV cache from the device's free
    memory at start-up. Blocks PyTorch caches after a training phase are free to torch but
    used to the driver: left cached, they make the KV cache's wake-up run out of memory
    although no tensor holds them. (vllm 0.32's allocator empties the cache in its wake-up
    too, unsynchronised; not every release does, and here the timeline sees how much.)"""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()  # no kernel may still use a block that is handed back
    before = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    return before, torch.cuda.memory_reserved()


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

    def release_cached_blocks(self, before: str) -> None:
        """`release_cached_blocks` before the engine step `before` (e.g. "wake_kv_cache"),
        with a row saying what PyTorch had reserved before and after (GPU only)."""
        reserved = release_cached_blocks()
        if reserved is not None:
            self.rows.append(
                {
                    "hand_off": before,
                    "engine": self.engine_state(),
                    "reserved_gib_before": reserved[0] / GIB,
                    "reserved_gib_after": reserved[1] / GIB,
                }
            )

    def end_step(self, step: int, stage: str) -> dict[str, float]:
        """The step's `memory/<phase>_peak_gib` (and `memory/<hand_off>_released_gib`)
        metrics; rank 0 writes the step's rows."""
        rows, self.rows = self.rows, []
        if self.path is not None and rows:
            with self.path.open("a") as f:
                for row in rows:
                    f.write(json.dumps({"stage": stage, "step": step, **row}) + "\n")
        out = {}
        for r in rows:
            if "phase" in r:
                out[f"memory/{r['phase']}_peak_gib"] = r["peak_gib"]
            else:
                released = r["reserved_gib_before"] - r["reserved_gib_after"]
                out[f"memory/{r['hand_off']}_released_gib"] = released
        return out
