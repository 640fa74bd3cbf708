"""Rollout engines vs model replicas (`rollout/replica.py`): which vLLM TP sizes a layout
accepts, and which engines serve which replica. The 4-rank trainer runs that generate through
them: tests/trainer/test_layouts_distributed.py."""

from __future__ import annotations

import pytest
from megatron.core.parallel_state import RankGenerator

from megatron_rl.config import ConfigError, load_config, validate_config
from megatron_rl.rollout.replica import ReplicaEngine, RolloutLayout

LAYOUTS = [  # (world, TP, PP)
    (4, 1, 2),
    (4, 2, 1),
    (4, 2, 2),
    (8, 2, 2),
    (16, 2, 4),
    (128, 8, 2),  # the 32B recipe
]


@pytest.mark.parametrize("world,tp,pp", LAYOUTS)
def test_coordinates_follow_megatrons_rank_order(world, tp, pp):
    """Megatron's own rank generator (order tp-cp-ep-dp-pp) puts each rank where
    `RolloutLayout.coordinates` says: the alignment rests on it."""
    layout = RolloutLayout(world, tp, pp, tp)
    dp = world // (tp * pp)
    ranks = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    for axis, index in (("tp", 0), ("dp", 1), ("pp", 2)):
        for group in ranks.get_ranks(axis):
            for position, rank in enumerate(group):
                assert layout.coordinates(rank)[index] == position, (axis, group, rank)


@pytest.mark.parametrize("world,tp,pp", LAYOUTS)
def test_every_divisor_of_tp_keeps_each_engine_in_one_replica(world, tp, pp):
    for vllm_tp in (t for t in range(1, tp + 1) if tp % t == 0):
        layout = RolloutLayout(world, tp, pp, vllm_tp)
        layout.check()
        dp = layout.data_parallel_size
        engines = [layout.replica_engines(d) for d in range(dp)]
        # every engine serves exactly one replica, and each replica TP x PP / vllm_tp engines
        assert sorted(e for es in engines for e in es) == list(range(world // vllm_tp))
        assert all(len(es) == tp * pp // vllm_tp for es in engines)


def test_an_engine_across_two_replicas_is_refused_naming_the_ranks():
    # PP2 x DP2: ranks 0, 1 are stage 0 of replicas 0 and 1; an engine of both would be fed
    # two replicas' prompts (the hang and the 0.23-nat log-prob gap seen before)
    with pytest.raises(ValueError, match=r"ranks 0\.\.1 in one vLLM engine .* data-parallel ranks \[0, 1\] .* TP=1 PP=2 DP=2"):  # fmt: skip
        RolloutLayout(4, 1, 2, 2).check()
    with pytest.raises(ValueError, match="divides parallel.tensor_model_parallel_size=2"):
        RolloutLayout(8, 2, 2, 4).check()  # the old default, TP x PP, at DP > 1
    with pytest.raises(ValueError, match="must be >= 1 and divide the world size 4"):
        RolloutLayout(4, 2, 1, 3).check()
    RolloutLayout(4, 2, 2, 4).check()  # DP = 1: one engine for the whole replica is fine


def test_a_replicas_engines_split_its_prompts_contiguously():
    layout = RolloutLayout(8, 1, 4, 1)  # DP 2, four stages, an engine per stage
    shares = []
    for rank in (0, 2, 4, 6):  # replica 0's stages
        engines = layout.replica_engines(layout.coordinates(rank)[1])
        e = ReplicaEngine(None, engines.index(layout.engine_of(rank)), len(engines), True)
        shares.append(e.share(10))
    assert shares == [(0, 2), (2, 5), (5, 7), (7, 10)]


def test_config_validation_refuses_a_misaligned_vllm_tp(tiny_model_dir):
    def config(*overrides):
        return load_config("examples/tiny/ppo.yaml", [f"model.path={tiny_model_dir}", *overrides])

    validate_config(config("parallel.pipeline_model_parallel_size=2"), world_size=4)
    with pytest.raises(ConfigError, match="rollout.vllm_tensor_parallel_size=2 puts ranks 0..1"):
        validate_config(
            config(
                "parallel.pipeline_model_parallel_size=2", "rollout.vllm_tensor_parallel_size=2"
            ),
            world_size=4,
        )
