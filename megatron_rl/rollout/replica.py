"""Rollout engines aligned with model replicas: every prompt of a step is generated once.

vLLM's external launcher makes one engine of every `vllm_tensor_parallel_size` consecutive
torchrun ranks. Megatron orders ranks tp-cp-ep-dp-pp (CP = EP = 1 here), so a model replica
(the TP x PP ranks of one data-parallel rank) is a consecutive block only when PP = 1 or
DP = 1. An engine must serve one replica, so its consecutive ranks must all lie in one:
`vllm_tensor_parallel_size` divides TP (or DP = 1 and it divides TP x PP). Anything else is
refused at config time (`RolloutLayout.check`), naming the ranks an engine would mix.

A replica then holds TP x PP / vllm_tp engines (one per pipeline stage by default, vLLM TP =
Megatron TP). `ReplicaEngine` uses them as one: every rank of the replica calls `generate`
with the replica's prompts; engine e generates its contiguous share, and the shares are
gathered over the replica's ranks, so each rank holds the whole rollout, in prompt order,
and no stage generates what another does (verl likewise sizes the rollout's data
parallelism by the rollout's TP, not the trainer's). With per-request seeds, which the
trainer always passes, a sample does not depend on which engine drew it.

Weights: every engine holds the whole model (`sync.weight_sync` broadcasts each stage's
tensors over the pipeline group), so sleep, wake-up and weight updates need no split.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from megatron_rl.parallel.collectives import gather_over_model_parallel
from megatron_rl.preemption import StepAborted
from megatron_rl.rollout.types import (
    Engine,
    EngineWrapper,
    GenerationStopped,
    Sample,
    SamplingConfig,
    WeightRefresh,
    check_generate,
)


@dataclass(frozen=True)
class RolloutLayout:
    """The torchrun world as Megatron and vLLM's external launcher each group it."""

    world_size: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    vllm_tensor_parallel_size: int

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (
            self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        )

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(tp, dp, pp) rank of a global rank in Megatron's tp-dp-pp order."""
        tp, dp = self.tensor_model_parallel_size, self.data_parallel_size
        return rank % tp, rank // tp % dp, rank // (tp * dp)

    def engine_of(self, rank: int) -> int:
        """The engine a rank belongs to (vLLM groups consecutive ranks)."""
        return rank // self.vllm_tensor_parallel_size

    def replica_engines(self, dp_rank: int) -> list[int]:
        """The engines serving model replica `dp_rank`, in rank order."""
        ranks = (r for r in range(self.world_size) if self.coordinates(r)[1] == dp_rank)
        return sorted({self.engine_of(r) for r in ranks})

    def check(self) -> None:
        """Raise ValueError, naming the sizes and the ranks, unless every engine's ranks lie
        in one model replica."""
        t = self.vllm_tensor_parallel_size
        if t < 1 or self.world_size % t:
            raise ValueError(
                f"rollout.vllm_tensor_parallel_size={t} must be >= 1 and divide the world "
                f"size {self.world_size}"
            )
        for first in range(0, self.world_size, t):
            replicas = sorted({self.coordinates(r)[1] for r in range(first, first + t)})
            if len(replicas) > 1:
                tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
                raise ValueError(
                    f"rollout.vllm_tensor_parallel_size={t} puts ranks {first}..{first + t - 1} "
                    f"in one vLLM engine (vLLM groups consecutive ranks), but Megatron gives "
                    f"them to the model replicas of data-parallel ranks {replicas} (ranks in "
                    f"tp-dp-pp order, TP={tp} PP={pp} DP={self.data_parallel_size}): one "
                    "engine would be fed two replicas' prompts. Use a vLLM TP that divides "
                    f"parallel.tensor_model_parallel_size={tp} (the default is TP itself)"
                )


def shift(samples: list[Sample], by: int) -> list[Sample]:
    """`samples` with their `prompt_index` moved by `by` (into or out of an engine's share)."""
    return [replace(s, prompt_index=s.prompt_index + by) for s in samples]


class ReplicaEngine(EngineWrapper):
    """The vLLM engines of one model replica, used as one engine.

    Dataflow of `generate(prompts)`, called by every rank of the replica with the same
    prompts: engine e takes prompts[bounds[e]:bounds[e+1]] (contiguous, sizes differing by
    at most one); its first rank contributes the samples to an all-gather over the
    replica's model-parallel group; every rank returns all samples, prompt-major, with
    `prompt_index` into `prompts`. It waits for the slowest engine of the replica. The rest
    of the `Engine` (sleep, wake_up, update_weights, dtype, awake, ...) is this rank's
    engine's: all engines hold the same weights.
    """

    def __init__(self, engine: Engine, engine_index: int, num_engines: int, is_engine_source: bool):
        super().__init__(engine)
        self.engine_index, self.num_engines = engine_index, num_engines
        self.is_engine_source = is_engine_source

    @property
    def partial_rollouts(self) -> bool:
        """Only with one engine: a refresh loads weights between the engine's own steps,
        which several engines of a replica would not agree on."""
        return self.num_engines == 1 and self.inner.partial_rollouts

    @classmethod
    def around(cls, engine, layout: RolloutLayout, rank: int) -> ReplicaEngine:
        """Wrap this rank's engine; checks that Megatron placed the rank where `layout`
        says (its rank order is what the alignment rests on)."""
        # why: megatron-core takes seconds to import: loaded on first use
        from megatron.core import parallel_state

        tp, dp, pp = layout.coordinates(rank)
        megatron = (
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_data_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_rank(),
        )
        if (tp, dp, pp) != megatron:
            raise RuntimeError(
                f"rank {rank}: Megatron placed it at (tp, dp, pp) = {megatron}, the rollout "
                f"layout expected {(tp, dp, pp)} (rank order tp-dp-pp)"
            )
        engines = layout.replica_engines(dp)
        return cls(
            engine,
            engines.index(layout.engine_of(rank)),
            len(engines),
            rank % layout.vllm_tensor_parallel_size == 0,
        )

    def share(self, n: int) -> tuple[int, int]:
        """[lo, hi) of n prompts that this rank's engine generates."""
        e, k = self.engine_index, self.num_engines
        return n * e // k, n * (e + 1) // k

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingConfig,
        seeds: list[int] | None = None,
        should_stop: Callable[[], bool] | None = None,
        tasks: list | None = None,
        refresh: WeightRefresh | None = None,
        partial: list[Sample] | None = None,
    ) -> list[Sample]:
        """`should_stop` (engines with `aborts_generation` only): an engine that aborts
        still takes part in the gather, so every rank of the replica raises `StepAborted`
        together, once the replica's other engines have finished their shares
        (`GenerationStopped` with every engine's responses where each can tell them).
        `tasks` (multi-turn engines, `rollout/agent.py`) and `partial`: shared like the
        prompts."""
        check_generate(self, prompts, seeds, should_stop, tasks, refresh, partial, sampling.n)
        if self.num_engines == 1:
            return self.inner.generate(
                prompts, sampling, seeds, should_stop, tasks, refresh, partial
            )
        lo, hi = self.share(len(prompts))
        aborted = False
        try:
            mine = self.inner.generate(
                prompts[lo:hi],
                sampling,
                None if seeds is None else seeds[lo:hi],
                should_stop,
                None if tasks is None else tasks[lo:hi],
                partial=None
                if partial is None
                else shift(partial[lo * sampling.n : hi * sampling.n], -lo),
            )
        except GenerationStopped as e:
            mine, aborted = e.samples, True
        except StepAborted:
            mine, aborted = None, True
        mine = None if mine is None else shift(mine, lo)
        shares = gather_over_model_parallel(
            (self.engine_index, mine, aborted) if self.is_engine_source else None
        )
        shares = [s for s in shares if s is not None]
        by_engine = {e: samples for e, samples, _ in shares}
        samples = None
        if all(by_engine[e] is not None for e in range(self.num_engines)):
            samples = [s for e in range(self.num_engines) for s in by_engine[e]]
        if any(engine_aborted for _, _, engine_aborted in shares):
            if samples is None:
                raise StepAborted("rollout/generate")
            raise GenerationStopped("rollout/generate", samples)
        return samples
