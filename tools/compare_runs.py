"""Whether two runs logged the same thing: every metrics row (value pretraining, the
evaluation before training, PPO) and every eval.jsonl row of each pair of run directories,
key for key and value for value, exactly. What a repeat cannot reproduce is left out: wall
times (`timing/*`, `perf/tokens_per_s`, a row's `time`) and measured memory (`memory/*`):
their keys are still compared.

    python -m tools.compare_runs RUN_A RUN_B [RUN_A2 RUN_B2 ...]

Exact equality is the point: two runs of one config with `trainer.deterministic: true` on the
same machine give the same numbers, so a refactor that claims to change nothing can show it
(on another machine, kernels may round differently: compare there only runs made there).
Exit status 1 when any pair differs, each difference printed.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

LOGS = ("metrics.jsonl", "eval.jsonl")
UNREPEATABLE_PREFIXES = ("timing/", "memory/")
UNREPEATABLE_KEYS = ("perf/tokens_per_s", "time")


def repeatable(key: str) -> bool:
    return not key.startswith(UNREPEATABLE_PREFIXES) and key not in UNREPEATABLE_KEYS


def rows(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as e:
        raise SystemExit(f"{path}: not a readable JSON-lines log ({e})") from None


def same(a, b) -> bool:
    both_nan = isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
    return a == b or both_nan


def differences(a: list[dict], b: list[dict], name: str) -> tuple[list[str], int]:
    """Each difference between two logs said in a line, and how many values were compared."""
    if len(a) != len(b):
        return [f"{name}: {len(a)} rows against {len(b)}"], 0
    out, values = [], 0
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if set(x) != set(y):
            out.append(f"{name} row {i}: keys only in one run: {sorted(set(x) ^ set(y))}")
        for key in sorted(set(x) & set(y)):
            if repeatable(key):
                values += 1
                if not same(x[key], y[key]):
                    out.append(f"{name} row {i} {key}: {x[key]!r} against {y[key]!r}")
    return out, values


def compare(run_a: Path, run_b: Path) -> tuple[list[str], int, int]:
    """(differences, rows compared, values compared) of two run directories."""
    found, n_rows, n_values = [], 0, 0
    for log in LOGS:
        a, b = rows(run_a / log), rows(run_b / log)
        diff, values = differences(a, b, f"{run_a.name}/{log}")
        found += diff
        n_rows, n_values = n_rows + len(a), n_values + values
    return found, n_rows, n_values


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="pairs of run directories: A B [A2 B2 ...]")
    a = p.parse_args(argv)
    if len(a.runs) % 2:
        p.error(f"runs come in pairs, got {len(a.runs)} directories")
    total_rows = total_values = 0
    failed = False
    for run_a, run_b in zip(a.runs[::2], a.runs[1::2], strict=True):
        found, n_rows, n_values = compare(run_a, run_b)
        total_rows, total_values = total_rows + n_rows, total_values + n_values
        for line in found:
            print(line)
        failed = failed or bool(found)
        print(f"{run_a} vs {run_b}: {n_rows} rows, {n_values} values "
              f"{'DIFFER' if found else 'equal'}")  # fmt: skip
    print(f"all pairs: {total_rows} rows, {total_values} values {'DIFFER' if failed else 'equal'}")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
