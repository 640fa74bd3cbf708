"""An engine rank of a disaggregated placement (#45; docs/design/async.md §3): it only
generates and scores. It holds the rollout engine (one per rank, vLLM TP 1), the tokenizer,
the prompts and the reward pool; no Megatron, no checkpoint. It answers the trainer rank 0's
commands (`trainer/disaggregated.py`) until told to shut down."""

from __future__ import annotations

from megatron_rl.config import TrainConfig
from megatron_rl.data import PromptStream, load_prompts
from megatron_rl.models.hf_mapping import expected_hf_shapes
from megatron_rl.models.source import ModelSource
from megatron_rl.parallel.placement import Placement
from megatron_rl.preemption import STOP, StepAborted
from megatron_rl.rewards.pool import make_scoring_pool
from megatron_rl.rollout.shm import ShmRecord
from megatron_rl.sync.weight_push import broadcast_object, receive_weights, send_object
from megatron_rl.sync.weight_sync import checked
from megatron_rl.trainer.disaggregated import (
    Evaluate,
    Generate,
    Rated,
    Shutdown,
    Weights,
    cross_role_groups,
)
from megatron_rl.trainer.rounds import (
    DataParallelShard,
    build_engine,
    build_evaluator,
    generate_round,
)


class EngineWorker:
    def __init__(self, config: TrainConfig, placement: Placement, store, rank: int):
        # transformers is heavy: loaded once a run is being built, not at import
        from transformers import AutoTokenizer

        c, t = config, config.trainer
        self.config, self.rank = config, rank
        self.replica = placement.role_rank(rank)
        self.replicas = placement.engine_ranks
        source = ModelSource(c.model.path)
        self.tokenizer = AutoTokenizer.from_pretrained(source.hf_dir)
        self.prompts = PromptStream(load_prompts(c.data, self.tokenizer), seed=t.seed)
        # Before the engine: a reward that cannot be imported or built fails in seconds.
        self.pool = make_scoring_pool(c.rewards.reward_fns, c.rewards.pool)
        self.shm = ShmRecord(t.output_dir, rank)
        self.shm.remove_stale()
        self.engine = build_engine(c, source, tensor_parallel_size=1, external_launcher=True)
        self.shm.write()
        self.evaluator = build_evaluator(
            c, self.engine, self.pool, self.tokenizer, self.replica, self.replicas, "cpu"
        )
        self.expected = expected_hf_shapes(source.architecture(), "actor")
        self.version = 0
        """The policy version the engine holds: the number of updates behind its weights."""
        self.stream, self.bridge = cross_role_groups(placement, store, rank)

    def run(self) -> None:
        """Answer commands until Shutdown."""
        while True:
            command = broadcast_object(self.stream, None, root=0)
            if isinstance(command, Shutdown):
                return
            if isinstance(command, Weights):
                self.load_weights()
            elif isinstance(command, Generate):
                send_object(self.stream, self.generate(command), dst=0)
            elif isinstance(command, Evaluate):
                send_object(self.stream, self.evaluator.local_sums(command.step), dst=0)
            else:
                raise TypeError(f"engine rank: unknown command {command!r}")

    def load_weights(self) -> None:
        version, pairs = receive_weights(self.bridge, root=0)
        self.engine.update_weights(checked(pairs, self.expected, self.engine.dtype))
        self.version = version

    def generate(self, command: Generate) -> Rated:
        """This replica's share of the step; a stop request (this rank's own, or one
        published in the job's store) aborts it, answered with no groups."""
        self.prompts.load_state_dict(command.data)

        def stop() -> bool:
            return STOP.requested

        shard = DataParallelShard(self.prompts, self.replica, self.replicas)
        try:
            rollout = generate_round(
                self.config, command.stage, command.step, shard, self.engine, self.pool,
                self.tokenizer, should_stop=stop, stop_generation=stop,
            )  # fmt: skip
        except StepAborted as e:
            return Rated(self.replica, [], {}, command.data, aborted=e.phase)
        return Rated(self.replica, rollout.groups, rollout.metrics, self.prompts.state_dict())

    def close(self) -> None:
        self.pool.close()
        self.engine.shutdown()
        self.shm.clean_up()
