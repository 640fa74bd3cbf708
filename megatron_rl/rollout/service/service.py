"""`RolloutService`: everything the trainer asks of the rollout side, one interface for both
placements (`rollout.placement`):

- `LocalRollout` (colocated): this rank's engine (vLLM, or `rollout.name: hf`), aligned with
  its model replica (`ReplicaEngine`), multi-turn where configured (`AgentEngine`), the reward
  pool and the evaluator, all in the trainer's process; it sleeps while Megatron trains.
- `RemoteRollout` (disaggregated): the engine ranks, driven over the wire protocol
  (`protocol.py`); they generate ahead as `async.max_staleness` allows, so it never sleeps.

The trainer holds one and never asks which: the same prompts, request seeds and weights give
the same groups either way (`rounds.generate_round` runs on whichever ranks generate).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from megatron_rl.config import TrainConfig
from megatron_rl.data import PromptStream
from megatron_rl.parallel.collectives import any_model_parallel_rank, is_model_parallel_source
from megatron_rl.preemption import STOP
from megatron_rl.rollout.evaluation import Evaluator
from megatron_rl.rollout.progress import (
    RolloutProgress,
    RolloutStopped,
    load_progress,
    progress_for,
)
from megatron_rl.rollout.service.protocol import EngineRanks
from megatron_rl.rollout.service.rounds import DataParallelShard, generate_round
from megatron_rl.rollout.shm import ShmRecord
from megatron_rl.rollout.strategies import Group
from megatron_rl.rollout.types import ENGINE_MEMORY, Engine
from megatron_rl.sync.lora_sync import ADAPTER_SYNC_DIR, LoRASync
from megatron_rl.sync.weight_sync import sync_weights


@dataclass
class Rollout:
    """This data-parallel rank's share of one step's rollout."""

    groups: list[Group]
    """Prompt-major rated groups (possibly fewer than asked: dynamic filtering)."""
    metrics: dict[str, float]
    aborted: str | None = None
    """The phase a stop request aborted it in (then no groups); the trainer aborts the step
    on every rank (`RLTrainer.abort_point`)."""
    progress: dict[int, RolloutProgress] = field(default_factory=dict)
    """What this rank keeps with the checkpoint when a stop ends the step (`rollout/
    progress.py`), by rollout replica: everything generated for the step, as far as the
    rollout got. Empty on the ranks that keep none."""


class RolloutService(Protocol):
    """What the trainer asks of the rollout side. Every trainer rank calls each method at the
    same point of the step (some are collectives of the trainers' world)."""

    evaluates: bool
    """Whether the run has eval sets (`trainer.eval_sets`)."""

    @property
    def awake(self) -> tuple[str, ...]:
        """Which of ENGINE_MEMORY the rollout side holds in this rank's device memory now
        (none when it lives on other ranks)."""

    def memory_state(self) -> str:
        """What the memory timeline records as the engine's state ("weights+kv_cache",
        "asleep", "apart")."""

    def generate(self, stage: str, step: int, prompts: PromptStream) -> Rollout:
        """This DP rank's share of `stage` step `step`'s rollout, drawn from `prompts` (left
        where the draws ended; as it was when the rollout was aborted); what
        `resume_progress` loaded of it is not generated again."""

    def resume_progress(self, checkpoint: Path) -> None:
        """Load what of the rollout a stop's `checkpoint` kept (`Rollout.progress`, every
        rank its own part), for the next `generate` to continue."""

    def push_weights(self, actor, version: int, evaluate: bool = False, changed: bool = True):
        """The actor's weights, policy `version` (PPO steps so far), to the engines.
        `evaluate`: an evaluation at `version` follows (the engine ranks make it at once,
        before they generate with later weights). `changed`: False when no update ran since
        the last push (the version still advances)."""

    def evaluate(self, step: int) -> tuple[dict[str, float], list[dict]]:
        """(metrics, eval.jsonl rows) of every eval set at PPO step `step`, with the weights
        of that step."""

    def sleep(self, level: int) -> None:
        """Free this rank's device memory for training (level 1: weights kept in host
        memory; 2: dropped, a push follows)."""

    def wake_up(self, tags: tuple[str, ...], why: str = "") -> None:
        """Bring `tags` back into device memory (`why`: names the occasion in the memory
        timeline)."""

    def close(self, failed: bool = False) -> None:
        """Release the engines (`failed`: an exception is on its way out)."""


class LocalRollout:
    """The colocated rollout side: this rank's engine among its replica's (module docstring),
    the reward pool, and a multi-turn run's environment workers (`env_pool`, or None).
    `release_cached_blocks(occasion)` runs before each wake-up (the memory timeline's: the
    allocator's cached blocks go back to the driver, which vLLM's wake-up allocates from)."""

    def __init__(
        self,
        config: TrainConfig,
        engine: Engine,
        pool,
        env_pool,
        tokenizer,
        evaluator: Evaluator,
        shm: ShmRecord,
        dp_rank: int,
        dp_size: int,
        release_cached_blocks: Callable[[str], None],
    ):
        self.config, self.engine, self.pool, self.tokenizer = config, engine, pool, tokenizer
        self.env_pool, self.evaluator, self.shm = env_pool, evaluator, shm
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.release_cached_blocks = release_cached_blocks
        self.evaluates = bool(evaluator)
        self.saved: dict[int, RolloutProgress] = {}
        """What a stop's checkpoint kept of this replica's rollout (`resume_progress`)."""
        lora = config.actor.lora
        self.lora_sync = (
            LoRASync(lora, Path(config.trainer.output_dir) / ADAPTER_SYNC_DIR, config.model.path)
            if lora.enabled and config.rollout.name == "vllm"
            else None
        )
        """A LoRA actor's syncs into vLLM: what its adapters change, after the first
        (`lora_sync.py`); the HF engine takes whole weights every time."""

    @property
    def awake(self) -> tuple[str, ...]:
        return tuple(t for t in ENGINE_MEMORY if t in self.engine.awake)

    def memory_state(self) -> str:
        return "+".join(sorted(self.engine.awake)) or "asleep"

    def stop_requested_in_replica(self) -> bool:
        """A stop request reached some rank of this model replica (the ranks that run one
        rollout in lockstep, so they stop together): asked between the rollout's chunks."""
        return any_model_parallel_rank(STOP.requested)

    def resume_progress(self, checkpoint: Path) -> None:
        self.saved = load_progress(checkpoint, [self.dp_rank])

    def generate(self, stage: str, step: int, prompts: PromptStream) -> Rollout:
        saved, self.saved = self.saved, {}
        progress = progress_for(saved, stage, step, self.dp_rank, self.dp_size)
        try:
            rollout = generate_round(
                self.config, stage, step, DataParallelShard(prompts, self.dp_rank, self.dp_size),
                self.engine, self.pool, self.tokenizer,
                should_stop=self.stop_requested_in_replica,
                stop_generation=lambda: STOP.requested,
                progress=progress,
            )  # fmt: skip
        except RolloutStopped as e:  # this replica; the others see the request at their check
            return Rollout([], {}, e.phase, self.kept(e.progress))
        return Rollout(rollout.groups, dict(rollout.metrics), None, self.kept(rollout.progress))

    def kept(self, progress: RolloutProgress) -> dict[int, RolloutProgress]:
        """The replica's progress, on its first rank (the one that writes it)."""
        return {self.dp_rank: progress} if is_model_parallel_source() else {}

    def push_weights(self, actor, version: int, evaluate: bool = False, changed: bool = True):
        if not changed:  # in place: the engine counts no versions, and evaluates when asked
            return
        if self.lora_sync is not None and getattr(actor, "lora", None) is not None:
            self.lora_sync.push(actor, self.engine)
            return
        sync_weights(actor, self.engine)  # whole weights (the teacher's too)
        if self.lora_sync is not None:
            self.lora_sync.weights_replaced()

    def evaluate(self, step: int) -> tuple[dict[str, float], list[dict]]:
        return self.evaluator.evaluate(step)

    def sleep(self, level: int) -> None:
        self.engine.sleep(level=level)

    def wake_up(self, tags: tuple[str, ...], why: str = "") -> None:
        self.release_cached_blocks(f"{why}wake_{'+'.join(tags)}")
        self.engine.wake_up(tags)

    def close(self, failed: bool = False) -> None:
        self.pool.close()
        if self.env_pool is not None:
            self.env_pool.close()
        self.engine.shutdown()  # its process groups first, then the trainer's
        self.shm.clean_up()


class RemoteRollout:
    """The disaggregated rollout side: the engine ranks (`engine_worker.py`), seen from the
    trainers through `EngineRanks`; `evaluator` only sums what they evaluated."""

    awake = ()

    def __init__(self, config: TrainConfig, ranks: EngineRanks, evaluator: Evaluator, pool):
        """`pool`: the reward pool, built here too so a reward that cannot be built fails
        on the trainers in seconds (the engine ranks score)."""
        self.config, self.ranks, self.evaluator, self.pool = config, ranks, evaluator, pool
        self.evaluates = bool(evaluator)
        self.saved: dict[int, RolloutProgress] = {}
        """Every replica's rollout a stop's checkpoint kept, on rank 0 (`resume_progress`)."""
        self.pushed_eval = None
        """The eval sums the engines made right after the last push (`push_weights`)."""

    def memory_state(self) -> str:
        return "apart"

    def resume_progress(self, checkpoint: Path) -> None:
        """Rank 0 loads every replica's (it sends them with the first round)."""
        self.saved = load_progress(checkpoint) if self.ranks.is_source else {}

    def generate(self, stage: str, step: int, prompts: PromptStream) -> Rollout:
        data, saved, self.saved = prompts.state_dict(), self.saved, {}
        if stage == "train":  # generated ahead as async.max_staleness allows
            answer = self.ranks.round(step, self.config.trainer.total_steps, data, saved)
        else:  # value pretraining: its policy is frozen, nothing to run ahead of
            answer = self.ranks.generate(stage, step, data, saved)
        groups, metrics, data, aborted, version, progress = answer
        if aborted is not None:
            return Rollout([], {}, aborted, progress)
        prompts.load_state_dict(data)  # the draws the engines made
        if stage == "train":
            metrics = {**metrics, "rollout/staleness": self.staleness(step, version)}
        return Rollout(groups, metrics, None, progress)

    def staleness(self, step: int, version: int) -> float:
        """How many updates older than the policy PPO step `step` trains (version `step`)
        the one that generated its rollout is; never more than async.max_staleness."""
        lag, bound = step - version, self.config.async_.max_staleness
        if not 0 <= lag <= bound:  # the engines' admission rule makes this a bug, never data
            raise RuntimeError(
                f"step {step + 1} got a rollout of policy version {version}: staleness {lag} "
                f"outside [0, async.max_staleness={bound}]"
            )
        return float(lag)

    def push_weights(self, actor, version: int, evaluate: bool = False, changed: bool = True):
        # pushed even unchanged: the engines' admission rule counts versions
        self.pushed_eval = self.ranks.push(actor, version, version if evaluate else None)

    def evaluate(self, step: int) -> tuple[dict[str, float], list[dict]]:
        """Sampled and scored on the engine ranks (right after the last push when it asked
        for it), summed here."""
        sums, self.pushed_eval = self.pushed_eval, None
        return self.evaluator.summarize(sums if sums is not None else self.ranks.evaluate(step))

    def sleep(self, level: int) -> None:
        """Nothing: the engines hold no memory of this rank."""

    def wake_up(self, tags: tuple[str, ...], why: str = "") -> None:
        """Nothing: the engines hold no memory of this rank."""

    def close(self, failed: bool = False) -> None:
        """Shutdown to the engine ranks; not when `failed`: mid-exchange the protocol's state
        is unknown and a wait could hang, so the launcher ends them when this rank exits with
        the error."""
        self.pool.close()
        if not failed:
            self.ranks.shutdown()
