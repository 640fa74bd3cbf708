"""Learning regression: the demo's recipe must still learn. One stored seed, the demo's
warm start, 10 PPO steps (2 CPU ranks, real vLLM); held-out accuracy must gain the margin
and stay within a band of the stored reference curve (tests/trainer/learning_reference.json),
wide enough for other CPUs' kernels and thread counts, narrow enough to catch a change that
slows learning down."""

import json
from pathlib import Path

import pytest

from examples.demo.demo import read_curves, run_rl, warm_start
from examples.demo.tasks import TASKS

pytestmark = [pytest.mark.distributed, pytest.mark.e2e]

REFERENCE = Path(__file__).parent / "learning_reference.json"


def test_vapo_recipe_learns_the_demo_task_like_the_reference(tiny_model_dir, tmp_path):
    ref = json.loads(REFERENCE.read_text())
    sft = tmp_path / "sft"
    warm_start(tiny_model_dir, sft, TASKS["sums"], threads=1)
    out = tmp_path / "vapo"
    last = max(int(step) for step in ref["eval"])
    overrides = [f"trainer.total_steps={last}", "trainer.eval_interval=5"]
    run_rl("examples/tiny/vapo.yaml", sft, out, ref["seed"], overrides, echo=False)
    evals = read_curves(out / "metrics.jsonl")["eval"]
    assert sorted(evals) == sorted(int(step) for step in ref["eval"]), evals
    assert evals[last] - evals[0] >= ref["min_gain"], evals
    for step, expected in ref["eval"].items():
        assert abs(evals[int(step)] - expected) <= ref["band"], (step, evals, ref["eval"])
