"""Unit tier: `tools/compare_runs.py` finds every difference of two runs' logs but the
unrepeatable ones (wall times, memory), whose keys it still compares."""

from __future__ import annotations

import json

import pytest

from tools import compare_runs


def write(run, metrics, evals):
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    (run / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    return run


def test_runs_equal_but_for_times_and_memory_are_equal(tmp_path, capsys):
    a = write(tmp_path / "a", [{"step": 1, "x": 0.5, "timing/s": 1.0, "memory/peak": 2.0}],
              [{"set": "greedy", "avg@1": 1.0}])  # fmt: skip
    b = write(tmp_path / "b", [{"step": 1, "x": 0.5, "timing/s": 9.0, "memory/peak": 3.0}],
              [{"set": "greedy", "avg@1": 1.0}])  # fmt: skip
    with pytest.raises(SystemExit) as done:
        compare_runs.main([str(a), str(b)])
    assert done.value.code == 0
    assert "2 rows, 4 values equal" in capsys.readouterr().out


def test_a_changed_value_a_missing_key_and_a_missing_row_are_each_said(tmp_path, capsys):
    a = write(tmp_path / "a", [{"step": 1, "x": 0.5, "timing/s": 1.0}], [{"avg@1": 1.0}])
    b = write(tmp_path / "b", [{"step": 1, "x": 0.25}], [{"avg@1": 1.0}, {"avg@1": 0.0}])
    with pytest.raises(SystemExit) as done:
        compare_runs.main([str(a), str(b)])
    out = capsys.readouterr().out
    assert done.value.code == 1
    assert "a/metrics.jsonl row 0: keys only in one run: ['timing/s']" in out
    assert "a/metrics.jsonl row 0 x: 0.5 against 0.25" in out
    assert "a/eval.jsonl: 1 rows against 2" in out


def test_nan_equals_nan_and_pairs_are_required(tmp_path):
    assert compare_runs.same(float("nan"), float("nan")) and not compare_runs.same(1.0, 1.5)
    with pytest.raises(SystemExit):
        compare_runs.main([str(tmp_path)])
