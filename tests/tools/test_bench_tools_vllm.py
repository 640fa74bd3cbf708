"""vLLM tier: `tools.bench tools` runs both loops on the same prompts and seeds, draws the
same trajectories with each, and reports the in-flight loop's speed-up."""

import json

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]  # a benchmark run: the journeys tier


def test_bench_tools_times_in_flight_against_turn_by_turn(tmp_path):
    from tools.bench_tools import main

    out = tmp_path / "results.jsonl"
    main(["--prompts", "2", "--n", "2", "--turns", "2", "--latency-s", "0.05", "--workers", "2",
          "--steps", "1", "--out", str(out)])  # fmt: skip
    (line,) = out.read_text().splitlines()
    result = json.loads(line)
    assert result["bench"] == "tools" and result["same_samples"] is True
    assert result["answered_calls"] > 0 and result["policy_tokens"] > 0
    assert set(result["seconds"]) == {"in_flight", "turns"}
    want = round(result["seconds"]["turns"] / result["seconds"]["in_flight"], 3)
    # from the unrounded times: the seconds printed are rounded to 1 ms
    assert result["speedup_in_flight_over_turns"] == pytest.approx(want, rel=0.01)
