"""What a GPU campaign's report says: the training step's bars against the plain-PyTorch peer,
each measured value beside its bar, and what the window decides among the choices that
wait for a GPU.

    python -m tools.gpu_verdict [bench/gpu_campaign/report.json]

The bars (`docs/performance.md`, the training step against plain PyTorch) at each campaign
shape: the PPO update at >= 1.0x the peer's tokens/s, at <= 1.0x its peak memory, at <=
1.05x a plain megatron forward-backward of the same tokens, the memory planner within 15% of
the measured peak; 0.5B x 32k trains; on the long-CoT batch ours >= 1.5x the peer padding
every row to the longest. The choices (`bench/gpu.md`, "For the next window"):
- `kept_probs`: the head keeping its probabilities for backward (the default) against
  recomputing its logits (`actor.logits_checkpointing`): keeping stays if it is not slower
  at any shape measured;
- `head_sums`: `model.use_fused_kernels` on by default for CUDA if the compiled tile sums
  make the whole update faster; else torch's fused softmax (`softmax_sums`) on CUDA if its
  sums beat the eager ones; else the eager sums stay;
- `flash_varlen`: packed attention in flash attention's variable-length kernel stays on if
  its GPU test passed, else `flash_varlen_runs` is narrowed (read from `gpu_tests.log`
  beside the report).
A part not in the report, or without the figure, reads "not measured": never a pass.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path

SHAPES = (
    ("train_step_bf16", "qwen2.5-0.5b, 4 x 2,048"),
    ("train_step_1b_4k", "qwen2-1b, 8 x 4,096"),
    ("train_step_16k", "qwen2.5-0.5b, 1 x 16,384"),
    ("train_step_32k", "qwen2.5-0.5b, 1 x 32,768"),
)
"""The campaign's train-step parts at the shapes the bars are set for."""
BARS = (
    ("speed_ppo_over_peer", "PPO update / peer tokens/s", 1.0, None),
    ("memory_ppo_over_peer", "PPO update / peer peak memory", None, 1.0),
    ("ratio_ppo_over_plain", "PPO update / plain forward-backward time", None, 1.05),
    ("planned_over_measured", "planner / measured peak", 0.85, 1.15),
)
"""(figure, what it is, lowest and highest it may be: None for no bound)."""
PARTS_READ = (
    "env",
    "train_step_bf16",
    "train_step_16k",
    "head_tile",
    "train_step_1b_4k",
    "train_step_32k",
    "long_cot_peer",
    "gpu_tests",
)
"""Every campaign part a full verdict reads (`env`: the device it names), the bars' shapes
first, the GPU tests last (`tools.gpu_campaign --verdict-call` runs them in two device
calls). `profile_16k` is also read for the compiled head, where an older report has it
from there alone."""
LONG_COT_BAR = 1.5
VARLEN_TEST = "test_packed_attention_in_one_flash_kernel_equals_one_call_a_segment"


@dataclass(frozen=True)
class Check:
    what: str
    value: float | None
    """None: not measured (the part or its figure missing)."""
    bar: str
    ok: bool | None
    """None where not measured."""

    def line(self) -> str:
        mark = {True: "pass", False: "FAIL", None: "not measured"}[self.ok]
        value = "-" if self.value is None else f"{self.value:g}"
        return f"{mark:<13} {self.what}: {value} (bar {self.bar})"


def result(report: dict, part: str) -> dict | None:
    """The last JSON line of `part`'s run, or None where it did not run or wrote none."""
    record = report.get("parts", {}).get(part, {})
    rows = record.get("results") or []
    return rows[-1] if record.get("status") == "passed" and rows else None


def figure(report: dict, key: str, *parts: str):
    """`key` from the first of `parts` whose result row has it, else None."""
    for part in parts:
        row = result(report, part) or {}
        if key in row:
            return row[key]
    return None


def ran_eager(report: dict, *parts: str) -> list[str]:
    """The head's compiled functions that failed and ran eager in `parts`' runs (`tools.bench
    train_step`'s `compiled_fell_back` fields): their arms timed no compiled kernel."""
    names = set()
    for part in parts:
        for key, value in (result(report, part) or {}).items():
            if key.endswith("compiled_fell_back"):
                names.update(value)
    return sorted(names)


def check(what: str, value, low: float | None, high: float | None) -> Check:
    bounds = ((">=", low), ("<=", high))
    bar = " and ".join(f"{sign} {b:g}" for sign, b in bounds if b is not None)
    if value is None:
        return Check(what, None, bar, None)
    ok = (low is None or value >= low) and (high is None or value <= high)
    return Check(what, float(value), bar, ok)


def planner_ratio(row: dict) -> float | None:
    """The plan over the PPO update's own peak, measured alone (`--memory` / `--apart`); the
    alternating process's peak (every arm's model at once) where only that was measured."""
    if "planned_gib" in row and row.get("ppo_update_peak_gib"):
        return round(row["planned_gib"] / row["ppo_update_peak_gib"], 4)
    return row.get("planned_over_measured")


def criteria(report: dict) -> list[Check]:
    """Every bar at every shape, then 32k training at all and the long-CoT batch."""
    checks = []
    for part, shape in SHAPES:
        row = result(report, part) or {}
        row = {**row, "planned_over_measured": planner_ratio(row)}
        for key, what, low, high in BARS:
            checks.append(check(f"{shape}: {what}", row.get(key), low, high))
    row = result(report, "train_step_32k") or {}
    trains = None if not row else "ppo_update_tokens_per_s" in row
    checks.append(Check("qwen2.5-0.5b, 1 x 32,768 trains on one GPU", None, "trains", trains))
    row = result(report, "long_cot_peer") or {}
    what = "long-CoT batch: packed / peer padded to the longest, tokens/s"
    checks.append(check(what, row.get("speedup_packed_over_peer"), LONG_COT_BAR, None))
    return checks


def choices(report: dict, gpu_tests_log: str = "") -> dict[str, str]:
    """What the window decides, by name: the change to make, or that the code stays.
    `gpu_tests_log`: the gpu_tests part's log (`-rfEsp` names every test's outcome)."""
    kept = {
        part: row["speed_kept_probs_over_logits_checkpointing"]
        for part in ("train_step_bf16", "train_step_32k")
        if "speed_kept_probs_over_logits_checkpointing" in (row := result(report, part) or {})
    }
    eager = ran_eager(report, *kept)
    if not kept:
        kept_probs = "not measured"
    elif eager:
        kept_probs = f"not measured: the compiled backward ran eager ({', '.join(eager)})"
    elif all(v >= 1.0 for v in kept.values()):
        kept_probs = f"keeping the head's probabilities stays the default ({kept})"
    else:
        kept_probs = f"set actor.logits_checkpointing to default true: keeping was slower ({kept})"

    compiled = figure(
        report, "speed_compiled_head_forward_over_eager", "train_step_16k", "profile_16k"
    )
    softmax = figure(report, "speed_softmax_over_eager", "head_tile")
    eager = ran_eager(report, "train_step_16k", "profile_16k")
    if compiled is None:
        head_sums = "not measured"
    elif eager:
        head_sums = f"not measured: compiled forms ran eager ({', '.join(eager)})"
    elif compiled > 1.0:
        head_sums = f"default model.use_fused_kernels to on for CUDA (the update {compiled}x)"
    elif softmax is None:
        head_sums = f"compiled sums lost ({compiled}x); softmax_sums not measured"
    elif softmax > 1.0:
        head_sums = f"take softmax_sums on CUDA ({softmax}x; compiled {compiled}x)"
    else:
        head_sums = f"the eager sums stay (compiled {compiled}x, softmax_sums {softmax}x)"

    flash_varlen = {
        "PASSED": "packed attention stays in the variable-length flash kernel",
        "FAILED": "narrow flash_varlen_runs: its GPU test failed",
        "ERROR": "narrow flash_varlen_runs: its GPU test failed",
    }.get(outcome_of(gpu_tests_log, VARLEN_TEST), "not measured")
    return {"kept_probs": kept_probs, "head_sums": head_sums, "flash_varlen": flash_varlen}


def outcome_of(log: str, name: str) -> str | None:
    """PASSED, FAILED, ERROR or SKIPPED: test `name`'s outcome in a pytest log, from the
    summary line (`-rfEsp`: "PASSED path::name") or, in a run cut before its summary, the
    line `-v` wrote as it ended ("path::name PASSED [ 40%]"); None where neither is."""
    outcomes = "PASSED|FAILED|ERROR|SKIPPED"
    found = re.search(rf"^({outcomes})\b.*::{name}\b", log, re.M) or re.search(
        rf"^\S*::{name}\b\S* ({outcomes})\b", log, re.M
    )
    return found and found.group(1)


def verdict(report: dict, gpu_tests_log: str = "") -> str:
    """The device, when each part used ran (a report merges windows), every bar, then the
    choices: the lines printed."""
    devices = (report.get("env") or {}).get("devices") or [{"name": "no CUDA device"}]
    lines = [f"GPU campaign report on {', '.join(d['name'] for d in devices)}"]
    for part in [*PARTS_READ, "profile_16k"]:
        record = report.get("parts", {}).get(part)
        when = "not run" if record is None else f"{record['status']} {record.get('finished')}"
        lines.append(f"  {part}: {when}")
    lines += [c.line() for c in criteria(report)]
    lines += [f"choice {name}: {t}" for name, t in choices(report, gpu_tests_log).items()]
    return "\n".join(lines)


def gpu_tests_log(out_dir: Path) -> str:
    """The gpu_tests part's log, which the campaign writes beside its report ("" if none)."""
    log = out_dir / "gpu_tests.log"
    return log.read_text(errors="replace") if log.exists() else ""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report", nargs="?", default="bench/gpu_campaign/report.json")
    a = p.parse_args(argv)
    path = Path(a.report)
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"{path}: cannot read a campaign report ({e})") from e
    print(verdict(report, gpu_tests_log(path.parent)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
