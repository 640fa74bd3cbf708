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
    Rounds,
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
        while self.obey():
            pass

    def obey(self) -> bool:
        """Read one command from trainer rank 0 and carry it out; False on Shutdown."""
        command = broadcast_object(self.stream, None, root=0)
        if isinstance(command, Shutdown):
            return False
        if isinstance(command, Weights):
            self.load_weights()
            if command.evaluate_step is not None:
                send_object(self.stream, self.evaluator.local_sums(command.evaluate_step), dst=0)
        elif isinstance(command, Generate):
            self.prompts.load_state_dict(command.data)
            send_object(self.stream, self.generate(command.stage, command.step), dst=0)
        elif isinstance(command, Rounds):
            return self.rounds(command)
        elif isinstance(command, Evaluate):
            send_object(self.stream, self.evaluator.local_sums(command.step), dst=0)
        else:
            raise TypeError(f"engine rank: unknown command {command!r}")
        return True

    def rounds(self, command: Rounds) -> bool:
        """PPO steps command.step.. end - 1 from command.data on, each started once the
        weights held are at most max_staleness versions behind it (`RoundsInFlight` is the
        trainers' mirror of this loop); commands are read while waiting for weights. False
        when one was Shutdown."""
        self.prompts.load_state_dict(command.data)
        for step in range(command.step, command.end):
            while self.version < step - command.max_staleness:
                if not self.obey():
                    return False
            answer = self.generate("train", step)
            send_object(self.stream, answer, dst=0)
            if answer.aborted:
                break
        return True

    def load_weights(self) -> None:
        version, pairs = receive_weights(self.bridge, root=0)
        self.engine.update_weights(checked(pairs, self.expected, self.engine.dtype))
        self.version = version

    def generate(self, stage: str, step: int) -> Rated:
        """This replica's share of `stage` step `step`, drawn from where the prompts are; a
        stop request (this rank's own, or one published in the job's store) aborts it,
        answered with no groups."""

        def stop() -> bool:
            return STOP.requested

        start = self.prompts.state_dict()
        shard = DataParallelShard(self.prompts, self.replica, self.replicas)
        try:
            rollout = generate_round(
                self.config, stage, step, shard, self.engine, self.pool,
                self.tokenizer, should_stop=stop, stop_generation=stop,
            )  # fmt: skip
        except StepAborted as e:
            return Rated(self.replica, [], {}, start, e.phase, step, self.version)
        return Rated(
            self.replica, rollout.groups, rollout.metrics, self.prompts.state_dict(), None,
            step, self.version,
        )  # fmt: skip

    def close(self) -> None:
        self.pool.close()
        self.engine.shutdown()
        self.shm.clean_up()
