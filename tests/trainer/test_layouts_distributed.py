"""The trainer at 4 CPU ranks in every two-axis layout: TP2 x DP2, PP2 x DP2, TP2 x PP2, with
actor, critic and reference (PPO, one value-pretraining step, then two PPO steps).

Each 4-rank run is compared with the 2-rank run of the same data-parallel size (DP2 for the
first two, TP2 for the third): the same prompts reach each model replica, and every sample
is seeded per request, so the maths says the steps must be the same; only the fp32 order of
the TP/PP split differs. Every engine must sample what its replica trains on: the
engine/trainer log-prob gap stays as small as at 2 ranks. (Before `rollout/replica.py`, PP2 x
DP2 hung in the first rollout with GRPO and trained on other tokens than it sampled with PPO,
a 0.23-nat gap.)

A tier of its own (`make test-layouts`, run by .ci/run): five torchrun jobs cost ~5 minutes
on 2 cores, which would take `make test` close to its 20-minute budget.
"""

from __future__ import annotations

import pytest
import torch

from tests.checkpoints import model_weights
from tests.tolerances import FP32_MODEL
from tests.trainer.runs import VARIED_REWARD, checkpoint, finite, metrics, train

pytestmark = [pytest.mark.distributed, pytest.mark.layouts]

STEPS = ("critic.pretrain_steps=1", "trainer.total_steps=2", "trainer.save_interval=0")
LAYOUTS = {  # name: (ranks, TP, PP, the 2-rank run with the same DP size)
    "tp2_dp2": (4, 2, 1, "dp2"),
    "pp2_dp2": (4, 1, 2, "dp2"),
    "tp2_pp2": (4, 2, 2, "tp2"),
    "dp2": (2, 1, 1, None),
    "tp2": (2, 2, 1, None),
}
NOISE = ("timing/", "memory/", "perf/tokens_per_s", "rollout/logprob_gap/", "rollout_corr/")
"""Metrics a layout may change: times, memory, and the engine/trainer gap (~1e-7 noise, and
the rollout-correction statistics made from it), which has a bound of its own below."""


def run_layout(name, model_dir, root):
    ranks, tp, pp, _ = LAYOUTS[name]
    out = root / name
    train(
        "ppo", out, f"model.path={model_dir}", VARIED_REWARD, *STEPS,
        f"parallel.tensor_model_parallel_size={tp}", f"parallel.pipeline_model_parallel_size={pp}",
        nproc=ranks, timeout=500,
    )  # fmt: skip
    return out


@pytest.fixture(scope="module")
def layout_run(tiny_model_dir, tmp_path_factory):
    """The output_dir of a layout's run, trained on first use (peers are shared)."""
    root, done = tmp_path_factory.mktemp("layouts"), {}

    def get(name):
        if name not in done:
            done[name] = run_layout(name, tiny_model_dir, root)
        return done[name]

    return get


def comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "stage" and not k.startswith(NOISE)}


@pytest.mark.parametrize("name", ["tp2_dp2", "pp2_dp2", "tp2_pp2"])
def test_a_four_rank_layout_trains_as_its_two_rank_peer(layout_run, name):
    out, peer = layout_run(name), layout_run(LAYOUTS[name][3])
    records = metrics(out)
    assert [r["step"] for r in records] == [1, 2] and all(finite(r) for r in records), records
    # every engine sampled the tokens its replica trains on (2 ranks: ~1e-6; before the
    # alignment PP2 x DP2 was 0.23)
    assert all(r["rollout/logprob_gap/max"] < 1e-4 for r in records), records
    expected = [comparable(r) for r in metrics(peer)]
    got = [comparable(r) for r in records]
    assert [sorted(r) for r in got] == [sorted(r) for r in expected]
    for g, e in zip(got, expected, strict=True):
        keys = sorted(e)
        torch.testing.assert_close(
            torch.tensor([g[k] for k in keys], dtype=torch.float64),
            torch.tensor([e[k] for k in keys], dtype=torch.float64),
            **FP32_MODEL,
            msg=lambda m, g=g, e=e: f"{m}\n{[(k, g[k], e[k]) for k in sorted(e) if g[k] != e[k]]}",
        )
    pretrain = metrics(out, "value_pretrain")
    assert len(pretrain) == 1 and finite(pretrain[0])
    # the same weights after value pretraining and two PPO steps, whatever the layout
    mine, theirs = checkpoint(out, 3), checkpoint(peer, 3)
    for role in ("actor", "critic"):
        a, b = model_weights(mine[role]), model_weights(theirs[role])
        assert sorted(a) == sorted(b)
        for k in a:
            torch.testing.assert_close(a[k], b[k], **FP32_MODEL, msg=f"{role} {k}")
