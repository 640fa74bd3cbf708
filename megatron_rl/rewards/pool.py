"""Where reward functions run: inline in the caller, or in a pool of Ray actors so that the
next chunk can be generated while this one is scored (a two-stage generate / score pipeline).

Both pools have the same two calls, `submit(batch) -> handle` and `result(handle)`; the inline
pool scores at `submit`, the Ray pool returns at once and splits the batch across its workers.
A stop request (`megatron_rl.preemption`) cancels the calls in flight within `CANCEL_POLL_S`
either way (an isolated function's child, or the Ray workers, killed) and raises
`StepAborted("rollout/score")`.
A reward model therefore loads once per Ray worker, never in the trainer process, unless the
Ray workers die: SLURM's `scancel` signals every process of the job, Ray's included, while
the trainer finishes its step to save it; the pool then scores in the trainer process.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_rl.child_process import CANCEL_POLL_S
from megatron_rl.parallel.collectives import broadcast_over_model_parallel, is_model_parallel_source
from megatron_rl.preemption import STOP, StepAborted
from megatron_rl.rewards.base import RewardInput
from megatron_rl.rewards.config import RewardFnConfig
from megatron_rl.rewards.scorer import RewardScorer, ScoredBatch


@dataclass(frozen=True)
class ScoringPoolConfig:
    num_workers: int = 0
    """0 scores inline in the calling process; >= 1 starts that many Ray reward workers."""
    ray_address: str | None = None
    """None starts a local Ray instance (if none is running in this process); "auto" or
    "ray://host:port" joins an existing cluster."""
    num_cpus_per_worker: float = 1.0
    num_gpus_per_worker: float = 0.0
    object_store_memory_mb: int = 256
    """For a locally started Ray only: reward payloads are small."""

    def __post_init__(self) -> None:
        if self.num_workers < 0:
            raise ValueError(f"scoring pool num_workers must be >= 0, got {self.num_workers}")


@dataclass
class TimedScores:
    scored: ScoredBatch
    started: float
    finished: float
    """Wall-clock (time.time) bounds of the scoring, for the overlap timeline."""


def score_timed(scorer: RewardScorer, batch: list[RewardInput]) -> TimedScores:
    started = time.time()
    scored = scorer(batch)
    return TimedScores(scored, started, time.time())


def concat(parts: Sequence[TimedScores]) -> TimedScores:
    names = parts[0].scored.scores
    merged = ScoredBatch(
        [r for p in parts for r in p.scored.rewards],
        {n: [v for p in parts for v in p.scored.scores[n]] for n in names},
        {n: [e for p in parts for e in p.scored.errors[n]] for n in names},
    )
    return TimedScores(merged, min(p.started for p in parts), max(p.finished for p in parts))


class InlineScoringPool:
    def __init__(self, reward_fns: Sequence[RewardFnConfig]):
        self.scorer = RewardScorer(reward_fns)

    def submit(self, batch: list[RewardInput]) -> TimedScores:
        return score_timed(self.scorer, batch)

    def result(self, handle: TimedScores) -> TimedScores:
        return handle

    def close(self) -> None:
        self.scorer.close()


class RayScoringPool:
    def __init__(self, reward_fns: Sequence[RewardFnConfig], config: ScoringPoolConfig):
        # why: ray takes seconds to import: only a reward pool starts it
        import ray

        for fn in reward_fns:
            if fn.collective:
                raise ValueError(
                    f"reward function {fn.display_name!r}: backend 'megatron' runs inside the "
                    "torchrun world; score it inline (scoring pool num_workers: 0) or use backend: hf"
                )
        self.reward_fns = list(reward_fns)
        self.fallback: InlineScoringPool | None = None
        self._started_ray = False
        if not ray.is_initialized():
            kwargs = dict(address=config.ray_address, logging_level=logging.WARNING)
            if config.ray_address is None:
                kwargs.update(
                    num_cpus=max(
                        os.cpu_count() or 1, int(config.num_workers * config.num_cpus_per_worker)
                    ),
                    object_store_memory=config.object_store_memory_mb * 2**20,
                    include_dashboard=False,
                )
            ray.init(**kwargs)
            self._started_ray = True
        worker_cls = ray.remote(RewardWorker).options(
            num_cpus=config.num_cpus_per_worker, num_gpus=config.num_gpus_per_worker
        )
        self.workers = [worker_cls.remote(list(reward_fns)) for _ in range(config.num_workers)]
        try:  # surface a worker that cannot build its functions now, not at the first batch
            ray.get([w.ready.remote() for w in self.workers])
        except Exception as e:
            self.close()
            # Ray's message is the worker's whole traceback; its last line is the error.
            reason = str(e).strip().splitlines()[-1]
            raise RuntimeError(f"reward workers failed to start: {reason}") from e

    def submit(self, batch: list[RewardInput]) -> tuple[list[RewardInput], list | None]:
        """(the batch, its Ray futures; None once the workers are gone)."""
        # why: ray takes seconds to import: only a reward pool starts it
        from ray.exceptions import RayError

        if self.fallback is not None:
            return batch, None
        n = len(self.workers)
        bounds = [len(batch) * i // n for i in range(n + 1)]
        try:
            return batch, [
                w.score.remote(batch[lo:hi])
                for w, lo, hi in zip(self.workers, bounds, bounds[1:], strict=False)
                if hi > lo
            ]
        except RayError as e:
            self._workers_lost(e)
            return batch, None

    def result(self, handle: tuple[list[RewardInput], list | None]) -> TimedScores:
        # why: ray takes seconds to import: only a reward pool starts it
        import ray
        from ray.exceptions import RayError, RayTaskError

        batch, futures = handle
        if futures is not None and self.fallback is None:
            try:
                while ray.wait(futures, num_returns=len(futures), timeout=CANCEL_POLL_S)[1]:
                    if STOP.requested:  # the calls in flight go with their workers
                        self._workers_lost(RuntimeError("killed for a stop request"), kill=True)
                        raise StepAborted("rollout/score")
                return concat(ray.get(futures))
            except RayTaskError:  # the reward function itself failed: not Ray's doing
                raise
            except RayError as e:
                self._workers_lost(e)
        return self.fallback.submit(batch)

    def _workers_lost(self, error: Exception, kill: bool = False) -> None:
        """From now on, score in this process (`kill`: the workers are ended here first)."""
        if kill:
            self._kill_workers()
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        print(
            f"warning: the Ray reward workers are gone ({reason}); scoring in this process "
            "from now on (a stopped job takes its Ray processes with it: the step still "
            "finishes and is saved)",
            flush=True,
        )
        self.fallback = InlineScoringPool(self.reward_fns)

    def _kill_workers(self) -> None:
        """Each worker's process ends (and its isolated reward children with it)."""
        # why: ray takes seconds to import: only a reward pool starts it
        import ray

        for w in getattr(self, "workers", []):
            try:
                ray.kill(w)
            except Exception:  # noqa: BLE001 - already dead with its Ray: nothing to stop
                pass
        self.workers = []

    def close(self) -> None:
        # why: ray takes seconds to import: only a reward pool starts it
        import ray

        self._kill_workers()
        if self.fallback is not None:
            self.fallback.close()
            self.fallback = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False


class RewardWorker:
    """One Ray actor: builds the reward functions once, scores the batches it is sent."""

    def __init__(self, reward_fns: list[RewardFnConfig]):
        self.scorer = RewardScorer(reward_fns)

    def ready(self) -> bool:
        return True

    def score(self, batch: list[RewardInput]) -> TimedScores:
        return score_timed(self.scorer, batch)


def make_scoring_pool(
    reward_fns: Sequence[RewardFnConfig], config: ScoringPoolConfig | None = None
):
    config = config or ScoringPoolConfig()
    if config.num_workers == 0:
        return InlineScoringPool(reward_fns)
    return RayScoringPool(reward_fns, config)


@dataclass(frozen=True)
class ScoringAborted:
    """What the scoring rank shares with its group in place of scores when a stop request
    cancelled the scoring (`rewards/isolated.py`): every rank then raises `StepAborted`
    together, none is left waiting in the broadcast."""

    phase: str


def submit_or_abort(pool, batch: list[RewardInput]):
    """`pool.submit(batch)`, or `ScoringAborted` when a stop cancelled it (an inline pool
    scores at submit)."""
    try:
        return pool.submit(batch)
    except StepAborted as e:
        return ScoringAborted(e.phase)


def result_or_abort(pool, handle) -> TimedScores | ScoringAborted:
    if isinstance(handle, ScoringAborted):
        return handle
    try:
        return pool.result(handle)
    except StepAborted as e:
        return ScoringAborted(e.phase)


def shared_or_raise(scores):
    """Scores as broadcast to a group: `StepAborted` on every rank where they were aborted."""
    if isinstance(scores, ScoringAborted):
        raise StepAborted(scores.phase)
    return scores


class ModelParallelScoringPool:
    """Scores each sample once per model-parallel (TP x PP) group.

    The ranks of a group generate the same samples (one vLLM engine, SPMD), so one rank
    scores them and broadcasts the scores: a non-deterministic reward (a sampling judge, a
    remote model) cannot give the ranks different rewards (different dynamic-filtering
    decisions would hang the next collective), and a remote service is called once per
    sample, not TP x PP times. Functions that are themselves collective (a reward model
    sharded by Megatron) still run on every rank of the group; the source's scores win.
    Every rank must call `submit` and `result` in the same order (the rating loop does).
    """

    def __init__(self, reward_fns: Sequence[RewardFnConfig], config: ScoringPoolConfig | None):
        self.is_source = is_model_parallel_source()
        if self.is_source:
            self.inner = make_scoring_pool(reward_fns, config)
        else:
            collective = [fn for fn in reward_fns if fn.collective]
            self.inner = InlineScoringPool(collective) if collective else None

    def submit(self, batch: list[RewardInput]):
        return None if self.inner is None else submit_or_abort(self.inner, batch)

    def result(self, handle) -> TimedScores:
        scores = result_or_abort(self.inner, handle) if self.is_source else None
        return shared_or_raise(broadcast_over_model_parallel(scores))

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
