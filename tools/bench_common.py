"""What every benchmark shares: arms timed alternately (machine noise hits both), and one
JSON line per run, printed and appended to bench/results.jsonl."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import torch

RESULTS = "bench/results.jsonl"


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def timed(fn: Callable[[], object]) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def alternate(arms: dict[str, Callable[[], object]], steps: int, warmup: int = 1) -> dict:
    """Run the arms in turn `warmup + steps` times; the median seconds of each arm."""
    times: dict[str, list[float]] = {name: [] for name in arms}
    for step in range(warmup + steps):
        for name, fn in arms.items():
            t = timed(fn)
            if step >= warmup:
                times[name].append(t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def record(bench: str, result: dict, out: str | None = RESULTS) -> dict:
    """Stamp `result` (bench, time, device, torch), print it as one JSON line, append it."""
    row = {
        "bench": bench,
        "time": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": device_name(),
        "torch": torch.__version__,
        **result,
    }
    line = json.dumps(row)
    print(line, flush=True)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        with open(out, "a") as f:
            f.write(line + "\n")
    return row
