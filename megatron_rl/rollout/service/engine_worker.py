"""An engine rank of a disaggregated placement (docs/design/async.md §3): it only
generates and scores. It holds its part of a rollout engine (vLLM TP t: t consecutive engine
ranks form one engine, a *replica*), the tokenizer, the prompts and, on a replica's first
rank, the reward pool; no Megatron, no checkpoint. Every rank of a replica carries out trainer
rank 0's commands (`rollout/service/protocol.py`) in step, as vLLM's TP needs; the first answers
for the replica. Until told to shut down.

With `async.partial_rollout` the worker is also its engine's `WeightRefresh`: asked inside a
round whether the doorbell rang, it reads the command there (`load`), so new weights (or an
evaluation, or Shutdown) reach it mid-generation; and asked for the next round
(`next_round`), it names it as soon as the admission rule lets it start, so the engine
generates it beside this round's tail (rounds interleaved)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rl.config import TrainConfig
from megatron_rl.data import PromptStream, load_prompts
from megatron_rl.models.hf_mapping import expected_hf_shapes
from megatron_rl.models.source import ModelSource
from megatron_rl.parallel.placement import Placement
from megatron_rl.preemption import STOP
from megatron_rl.rewards.pool import (
    make_scoring_pool,
    result_or_abort,
    shared_or_raise,
    submit_or_abort,
)
from megatron_rl.rollout.progress import RolloutStopped, progress_for
from megatron_rl.rollout.rating import chunk_seeds
from megatron_rl.rollout.service.protocol import (
    DOORBELL_KEY,
    Evaluate,
    Generate,
    Rated,
    Ready,
    Rounds,
    Shutdown,
    Weights,
    cross_role_groups,
)
from megatron_rl.rollout.service.rounds import (
    DataParallelShard,
    build_engine,
    build_evaluator,
    generate_round,
    prompt_tools,
    round_seed,
)
from megatron_rl.rollout.shm import ShmRecord
from megatron_rl.rollout.strategies import make_strategy
from megatron_rl.sync.weight_push import broadcast_object, post_object, receive_weights
from megatron_rl.sync.weight_sync import checked


class EngineShutdown(Exception):
    """Shutdown read inside a round (partial rollouts): unwinds the round, nothing answered."""


class EngineWorker:
    def __init__(self, config: TrainConfig, placement: Placement, store, rank: int):
        # transformers is heavy: loaded once a run is being built, not at import
        from transformers import AutoTokenizer

        c, t = config, config.trainer
        self.config, self.rank = config, rank
        tp = c.rollout.vllm_tensor_parallel_size or 1
        engine_rank = placement.role_rank(rank)
        self.replica, self.replicas = engine_rank // tp, placement.engine_ranks // tp
        self.leader = engine_rank % tp == 0
        """The replica's first rank: it scores, and answers trainer rank 0."""
        # every engine rank makes every replica's group, in order (a collective of the
        # engines' world); gloo: flags and scores are host objects. TP 1: nothing to agree.
        self.replica_group, self.replica_leader = None, engine_rank
        for first in range(0, placement.engine_ranks, tp) if tp > 1 else ():
            group = dist.new_group(list(range(first, first + tp)), backend="gloo")
            if first <= engine_rank < first + tp:
                self.replica_group, self.replica_leader = group, first
        source = ModelSource(c.model.path)
        self.tokenizer = AutoTokenizer.from_pretrained(source.hf_dir)
        self.prompts = PromptStream(
            load_prompts(c.data, self.tokenizer, prompt_tools(c)), seed=t.seed
        )
        # Before the engine: a reward that cannot be imported or built fails in seconds.
        inner = make_scoring_pool(c.rewards.reward_fns, c.rewards.pool) if self.leader else None
        self.pool = ReplicaScoring(inner, self.replica_group, self.replica_leader)
        self.shm = ShmRecord(t.output_dir, rank)
        self.shm.remove_stale()
        self.engine = build_engine(c, source, tensor_parallel_size=tp, external_launcher=True)
        self.shm.write()
        self.evaluator = build_evaluator(
            c, self.engine, self.pool, self.tokenizer, self.replica, self.replicas, "cpu"
        )
        self.expected = expected_hf_shapes(source.architecture(), "actor")
        self.version = 0
        """The policy version the engine holds: the number of updates behind its weights."""
        self.store, self.commands_read = store, 0
        self.posted = []
        """Answers sent and maybe not yet received: the engine goes on meanwhile, so it can
        run as many rounds ahead as the admission rule lets it."""
        self.partial_rollout = c.async_.partial_rollout
        rating, share = c.rollout.rating, c.rollout.rollout_batch_size // self.replicas
        self.interleave = (
            self.partial_rollout
            and make_strategy(rating.strategy, rating.strategy_options).exact
            and (rating.chunk_size or share) >= share
        )
        """Rounds interleaved where a round is one engine call of known prompts (a strategy
        that keeps every group, one chunk): a filtering round's later draws depend on its
        scores, so the next round's prompts are not known before it ends."""
        self.run_of_rounds: Rounds | None = None
        self.step = -1
        """The round generating (within `run_of_rounds`)."""
        self.admitted: dict[int, int] = {}
        """Round -> the version held when it was admitted ahead (its head version)."""
        self.stream, self.bridge = cross_role_groups(placement, store, rank)

    def run(self) -> None:
        """Answer commands until Shutdown."""
        while self.obey():
            pass

    def obey(self) -> bool:
        """Read one command from trainer rank 0 and carry it out; False on Shutdown."""
        command = self.read_command()
        if isinstance(command, Shutdown):
            return False
        if isinstance(command, (Weights, Evaluate)):
            self.weights_or_evaluate(command)
        elif isinstance(command, Generate):
            self.prompts.load_state_dict(command.data)
            self.answer(self.generate(command.stage, command.step, command.saved))
        elif isinstance(command, Rounds):
            return self.rounds(command)
        else:
            raise TypeError(f"engine rank: unknown command {command!r}")
        return True

    def read_command(self):
        """The next command, once trainer rank 0 knows this replica listens (`Ready`)."""
        self.answer(Ready(self.replica))
        self.commands_read += 1
        command = broadcast_object(self.stream, None, root=0)
        # trainer rank 0 sends a command only once it has received every answer up to Ready
        for posted in self.posted:
            posted.wait()
        self.posted.clear()
        return command

    def weights_or_evaluate(self, command: Weights | Evaluate) -> None:
        if isinstance(command, Weights):
            self.load_weights()
            if command.evaluate_step is not None:
                self.answer(self.evaluator.local_sums(command.evaluate_step))
        else:
            self.answer(self.evaluator.local_sums(command.step))

    def rounds(self, command: Rounds) -> bool:
        """PPO steps command.step.. end - 1 from command.data on, each started once the
        weights held are at most max_staleness versions behind it; commands are read while
        waiting for weights and, with partial rollouts, whenever the doorbell rang. False
        when one was Shutdown."""
        self.prompts.load_state_dict(command.data)
        self.run_of_rounds = command
        try:
            for step in range(command.step, command.end):
                while self.version < step - command.max_staleness or (
                    self.partial_rollout and self.agreed(self.pending())
                ):
                    if not self.obey():
                        return False
                self.step = step
                answer = self.generate("train", step, command.saved)
                self.answer(answer)
                if answer.aborted:
                    break
        except EngineShutdown:
            return False
        finally:
            self.run_of_rounds = None
            if self.interleave:  # a round admitted ahead of a stop is regenerated on resume
                self.admitted.clear()
                self.engine.drop_ahead()
        return True

    # WeightRefresh (`VLLMEngine.generate`), for partial rollouts
    def pending(self) -> bool:
        """Whether the doorbell rang for a command this rank has not read (the engine
        agrees over its ranks)."""
        return int(self.store.add(DOORBELL_KEY, 0)) > self.commands_read

    def load(self) -> int:
        """Read the waiting command inside a round (the engine is empty): new weights, an
        evaluation, or Shutdown (raised); returns the version held."""
        command = self.read_command()
        if isinstance(command, Shutdown):
            raise EngineShutdown
        if not isinstance(command, (Weights, Evaluate)):
            raise TypeError(f"engine rank: {command!r} inside a round")
        self.weights_or_evaluate(command)
        return self.version

    def next_round(self) -> tuple[list[list[int]], list[int]] | None:
        """The next round's prompts and request seeds, once the version held lets it start
        (>= its step - max_staleness) and while no round waits ahead: what its own
        `generate_round` will draw (the stream is put back) and ask the engine for."""
        run, step = self.run_of_rounds, self.step + 1
        if (
            not self.interleave
            or run is None
            or step >= run.end
            or step in self.admitted
            or self.version < step - run.max_staleness
        ):
            return None
        start = self.prompts.state_dict()
        shard = DataParallelShard(self.prompts, self.replica, self.replicas)
        batch = shard.take(self.config.rollout.rollout_batch_size // self.replicas)
        self.prompts.load_state_dict(start)
        self.admitted[step] = self.version
        seeds = chunk_seeds(round_seed(self.config, "train", step), batch, chunk=0)
        return [p.prompt_token_ids for p in batch], seeds

    def answer(self, obj) -> None:
        """To trainer rank 0, from the replica's first rank (the others made the same),
        without waiting for it to be received (`posted`)."""
        if self.leader:
            self.posted.append(post_object(self.stream, obj, dst=0))

    def stop_requested(self) -> bool:
        """A stop request on any rank of this replica (its ranks run one vLLM engine in
        step, so they must all stop at the same check)."""
        return self.agreed(STOP.requested)

    def agreed(self, flag: bool) -> bool:
        """`flag` on any rank of this replica (gloo: a host flag, no device sync)."""
        if self.replica_group is None or dist.get_world_size(self.replica_group) == 1:
            return flag
        t = torch.tensor([int(flag)], device="cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.replica_group)
        return bool(t.item())

    def load_weights(self) -> None:
        version, pairs = receive_weights(self.bridge, root=0)
        self.engine.update_weights(checked(pairs, self.expected, self.engine.dtype))
        self.version = version

    def generate(self, stage: str, step: int, saved: dict) -> Rated:
        """This replica's share of `stage` step `step`, drawn from where the prompts are,
        taking what `saved` holds of it (a stop's checkpoint); a stop request (this rank's
        own, or one published in the job's store) aborts it, answered with no groups and
        what it generated."""

        def stop() -> bool:  # inside one engine call: the engine agrees over its TP group
            return STOP.requested

        # a round admitted ahead: its head version is the one held when it started
        interleaved = step in self.admitted
        start, head = self.prompts.state_dict(), self.admitted.pop(step, self.version)
        shard = DataParallelShard(self.prompts, self.replica, self.replicas)
        refresh = self if self.partial_rollout and stage == "train" else None
        progress = progress_for(saved, stage, step, self.replica, self.replicas)
        if progress is not None:  # it started under the version that made its first tokens
            head = progress.version
        try:
            rollout = generate_round(
                self.config, stage, step, shard, self.engine, self.pool, self.tokenizer,
                should_stop=self.stop_requested, stop_generation=stop, refresh=refresh,
                progress=progress, version=head,
            )  # fmt: skip
        except RolloutStopped as e:
            return Rated(self.replica, [], {}, start, e.phase, step, head, e.progress)
        if refresh is not None and self.interleave:
            rollout.metrics["rollout/interleaved"] = float(interleaved)
        return Rated(
            self.replica, rollout.groups, rollout.metrics, self.prompts.state_dict(), None,
            step, head, rollout.progress,
        )  # fmt: skip

    def close(self) -> None:
        self.pool.close()
        self.engine.shutdown()
        self.shm.clean_up()


class ReplicaScoring:
    """The reward pool of a replica: its first rank scores (inline or with its Ray pool),
    the others get the same scores over the replica's group, so a reward that is not
    deterministic (a sampling judge, a remote model) cannot split the replica's decisions
    (dynamic filtering) and a remote service is called once per sample."""

    def __init__(self, inner, group, leader: int):
        self.inner, self.group, self.leader = inner, group, leader

    def submit(self, batch):
        return submit_or_abort(self.inner, batch) if self.inner is not None else None

    def result(self, handle):
        scores = [result_or_abort(self.inner, handle) if self.inner is not None else None]
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.broadcast_object_list(scores, src=self.leader, group=self.group)
        return shared_or_raise(scores[0])

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
