"""The rollout side of a run, made in two halves around the trainer's models:

1. `RolloutBuilder(...)`, before any model: the reward pool, and for a colocated multi-turn
   run the tool format (checked against the tokenizer) and the environment's workers, so a
   reward or an environment that cannot be built fails in seconds;
2. `build(...)`, once the models exist and what the config offloads has left the device: the
   engine sizes its KV cache from the device memory free then (colocated), or the trainers
   connect to the engine ranks (disaggregated).

`join_placement` is where a disaggregated job splits into trainers and engine ranks, and
`serve_engine_rank` all an engine rank does."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from megatron_rl.config import TrainConfig, rollout_layout, validate_config
from megatron_rl.models.source import ModelSource
from megatron_rl.parallel.placement import ENGINE, Placement, initialize_role
from megatron_rl.preemption import STOP
from megatron_rl.rewards.pool import ModelParallelScoringPool
from megatron_rl.rollout.replica import ReplicaEngine
from megatron_rl.rollout.service.protocol import EngineRanks
from megatron_rl.rollout.service.rounds import (
    agent_engine,
    agent_spec,
    build_engine,
    build_env_pool,
    build_evaluator,
)
from megatron_rl.rollout.service.service import LocalRollout, RemoteRollout, RolloutService
from megatron_rl.rollout.shm import ShmRecord


@dataclass(frozen=True)
class EnginesApart:
    """This rank's place in a disaggregated job: the split, the job's store, and whether
    this rank is one of the engine ranks."""

    placement: Placement
    store: object
    rank: int
    role: str

    @property
    def is_engine(self) -> bool:
        return self.role == ENGINE


def join_placement(config: TrainConfig) -> EnginesApart | None:
    """Colocated: None (every rank trains and generates). Disaggregated: the job split into
    trainers and engine ranks (`parallel.placement.initialize_role`: each role's default
    group), this rank's place in it. The config is validated first, on every rank, before
    any process group."""
    if config.rollout.placement == "colocated":
        return None
    world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    validate_config(config, world_size)
    placement = Placement(world_size, config.rollout.engine_ranks)
    role, store = initialize_role(placement)
    return EnginesApart(placement, store, rank, role)


def serve_engine_rank(config: TrainConfig, apart: EnginesApart) -> None:
    """An engine rank's whole life: generate, score and evaluate as trainer rank 0 commands
    (`engine_worker.py`) until it says Shutdown."""
    # why: only engine ranks load it (vLLM, no Megatron)
    from megatron_rl.rollout.service.engine_worker import EngineWorker

    STOP.share_through(apart.store, apart.rank)  # a request on any rank reaches this one
    worker = EngineWorker(config, apart.placement, apart.store, apart.rank)
    try:
        worker.run()
    finally:
        worker.close()


class RolloutBuilder:
    """The rollout side of this trainer rank (module docstring)."""

    def __init__(self, config: TrainConfig, ctx, tokenizer, apart: EnginesApart | None):
        """`ctx`: the trainer's `DistributedContext`."""
        self.config, self.ctx, self.tokenizer, self.apart = config, ctx, tokenizer, apart
        self.pool = ModelParallelScoringPool(config.rewards.reward_fns, config.rewards.pool)
        self.agent = self.env_pool = None
        if apart is None and config.rollout.multi_turn.enable:  # colocated only (validate.py)
            self.agent = agent_spec(config, tokenizer)
            vllm_tp = rollout_layout(config, ctx.world_size).vllm_tensor_parallel_size
            self.env_pool = build_env_pool(config, ctx.rank, vllm_tp)

    def build(self, release_cached_blocks: Callable[[str], None]) -> RolloutService:
        """The service; `release_cached_blocks(occasion)`: the memory timeline's, run before
        each wake-up of a colocated engine."""
        c, ctx = self.config, self.ctx
        if self.apart is not None:  # the engines are other ranks (`engine_worker.py`)
            ranks = EngineRanks(
                self.apart.placement, self.apart.store, ctx, c.async_.max_staleness,
                c.rollout.vllm_tensor_parallel_size or 1,
            )  # fmt: skip
            evaluator = build_evaluator(
                c, None, self.pool, self.tokenizer, ctx.dp_rank, ctx.dp_size, ctx.device
            )
            return RemoteRollout(c, ranks, evaluator, self.pool)
        shm = ShmRecord(c.trainer.output_dir, ctx.rank)
        stale = shm.remove_stale()
        if stale:
            print(f"removed {len(stale)} shared-memory file(s) a killed run left: {stale}")
        engines = rollout_layout(c, ctx.world_size)
        tp = engines.vllm_tensor_parallel_size
        engine = build_engine(c, ModelSource(c.model.path), tp, "WORLD_SIZE" in os.environ)
        if self.agent is not None:
            engine = agent_engine(engine, self.agent, self.env_pool, self.tokenizer, ctx.rank, tp)
        # One generation per model replica, split over its engines (`rollout/replica.py`).
        engine = ReplicaEngine.around(engine, engines, ctx.rank)
        shm.write()
        evaluator = build_evaluator(
            c, engine, self.pool, self.tokenizer, ctx.dp_rank, ctx.dp_size, ctx.device
        )
        return LocalRollout(
            c, engine, self.pool, self.env_pool, self.tokenizer, evaluator, shm,
            ctx.dp_rank, ctx.dp_size, release_cached_blocks,
        )  # fmt: skip
