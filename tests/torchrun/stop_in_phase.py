"""torchrun worker: `megatron_rl.cli.train` with a stop request made at an exact point of a
step, as a scheduler's signal would land there, but deterministically (a signal's timing
races on two cores).

    --stop-at STAGE:STEP:PHASE [train args ...]

STAGE is train or value_pretrain, STEP the step (1-based) in which to ask, PHASE one of the
trainer's abort points (`RLTrainer.abort_point`: rollout, experience/actor,
experience/reference, experience/critic, train, train/optimizer_step, train/mini_batch: the
first later mini-batch's), rollout/score: the rating loop's check before it collects a
chunk's scores, i.e. once the chunk is generated and its prompts drawn, or rollout/generate:
the vLLM engine's second stop check inside its generation (after `ABORT_CHECK_STEPS` engine
steps), or save: the start of STEP's own save (a periodic one: the request lands while it is
written). The first rank there creates the stop file ($MEGATRON_RL_STOP_FILE) just before
that point asks whether anyone wants to stop, as the launcher would on a SIGTERM. With
`rollout.placement=disaggregated`, rollout/generate is the engine rank's generation.

    --signal-rank R: instead, rank R sends itself SIGUSR1 at that point (a signal only it
    gets: no stop file) and every other rank waits there until the request reaches it
    through the job's store (`StopRequest.share_through`): still generating, say.

    --push-inside-rounds: partial rollouts made deterministic (`push_inside_rounds`).
    Without --stop-at, no stop is asked.

`install(stop_at, at_point)` sets the same hooks with another action at that point (the SLURM
test holds the generation there until the scheduler's real signal arrives:
tests/slurm/hold_generation/sitecustomize.py).
"""

import argparse
import os
import signal
import time
from collections.abc import Callable

from megatron_rl.preemption import STOP, request_stop, stop_file
from megatron_rl.rollout.service import engine_worker
from megatron_rl.rollout.service.engine_worker import EngineWorker
from megatron_rl.rollout.service.service import LocalRollout
from megatron_rl.rollout.vllm_engine import VLLMEngine
from megatron_rl.trainer.runner import RLTrainer


def install(stop_at: str, at_point: Callable[[int], None]) -> None:
    """Call `at_point(rank)` on every rank when the run reaches `stop_at`
    (STAGE:STEP:PHASE), right before that point asks whether anyone wants to stop."""
    stage, step, phase = stop_at.split(":")
    rank = {"r": None}

    def arrived(trainer: RLTrainer, finished: bool = False) -> bool:
        """In step STEP of STAGE (`finished`: its save, once the step counter moved on)."""
        rank["r"] = trainer.ctx.rank
        in_stage = "value_pretrain" if not trainer.value_pretrain_done else "train"
        current = trainer.value_pretrain_step if in_stage == "value_pretrain" else trainer.step
        return in_stage == stage and current + (0 if finished else 1) == int(step)

    def ask() -> None:
        at_point(rank["r"])

    abort_point, in_replica = RLTrainer.abort_point, LocalRollout.stop_requested_in_replica
    calls = {"n": 0}
    generating = {"trainer": None}  # the trainer whose rollout is running

    def abort_point_asking(self, name, aborted=False):
        if name == phase and arrived(self):
            ask()
        return abort_point(self, name, aborted)

    def in_replica_asking(self):
        # the rating loop asks before its one chunk is generated (call 1), then before the
        # chunk's scores are collected (call 2)
        trainer = generating["trainer"]
        if phase == "rollout/score" and trainer is not None and arrived(trainer):
            calls["n"] += 1
            if calls["n"] == 2:
                ask()
        return in_replica(self)

    save = RLTrainer.save

    def save_asking(self):
        # trainer.step already counts the step being saved
        if phase == "save" and arrived(self, finished=True):
            ask()
        return save(self)

    generate_and_score = RLTrainer.generate_and_score
    any_engine_rank = VLLMEngine._any_engine_rank
    armed = {"on": False, "n": 0}

    def generate_and_score_arming(self, *args, **kwargs):
        armed["on"] = phase == "rollout/generate" and arrived(self)
        generating["trainer"] = self
        try:
            return generate_and_score(self, *args, **kwargs)
        finally:
            armed["on"], generating["trainer"] = False, None

    def any_engine_rank_asking(flag: bool) -> bool:
        if armed["on"]:
            armed["n"] += 1
            if armed["n"] == 2:
                ask()
                flag = flag or STOP.requested  # as the engine's own `should_stop()` now would
        return any_engine_rank(flag)

    engine_generate = EngineWorker.generate

    def engine_generate_arming(self, rollout_stage, rollout_step, saved):
        # an engine rank of a disaggregated placement: the generation is its own
        rank["r"] = self.rank
        here = (rollout_stage, rollout_step + 1) == (stage, int(step))
        armed["on"] = phase == "rollout/generate" and here
        try:
            return engine_generate(self, rollout_stage, rollout_step, saved)
        finally:
            armed["on"] = False

    EngineWorker.generate = engine_generate_arming
    RLTrainer.abort_point = abort_point_asking
    LocalRollout.stop_requested_in_replica = in_replica_asking
    RLTrainer.generate_and_score = generate_and_score_arming
    RLTrainer.save = save_asking
    VLLMEngine._any_engine_rank = staticmethod(any_engine_rank_asking)


class PushInsideRound:
    """The `WeightRefresh` of an engine rank's round `step` (async.partial_rollout), holding
    the generation at its second check (`ABORT_CHECK_STEPS` tokens in) until the push made
    after the previous step's update has rung (or any command: a Shutdown), so that push is
    read inside the round, as a generation longer than an update would make it happen (`hold`
    False: a launch's first round, made with the weights it trains). It has no `next_round`:
    rounds are not interleaved, each generated whole by its own call."""

    def __init__(self, inner, step: int, hold: bool, timeout_s: float = 120.0):
        self.inner, self.step, self.checks, self.timeout_s = inner, step, 0, timeout_s
        self.hold = hold

    @property
    def version(self) -> int:
        return self.inner.version

    def pending(self) -> bool:
        self.checks += 1
        deadline = time.time() + self.timeout_s
        while (
            self.hold
            and self.checks == 2
            and self.inner.version < self.step
            and not self.inner.pending()
        ):
            if time.time() > deadline:
                raise RuntimeError(f"round {self.step}: no push came in {self.timeout_s} s")
            time.sleep(0.01)
        return self.inner.pending()

    def load(self) -> int:
        return self.inner.load()

    def next_round(self) -> None:
        return None


def push_inside_rounds() -> None:
    """Every PPO round but a launch's first (made with the weights it trains, nothing to
    wait for) takes the next push inside its generation (`PushInsideRound`)."""
    generate_round, first = engine_worker.generate_round, []

    def holding(config, stage, step, *args, refresh=None, **kwargs):
        if refresh is not None:
            first.append(step)
            refresh = PushInsideRound(refresh, step, hold=step > first[0])
        return generate_round(config, stage, step, *args, refresh=refresh, **kwargs)

    engine_worker.generate_round = holding


def wait_for_request(timeout_s: float = 120.0) -> None:
    deadline = time.time() + timeout_s
    while not STOP.requested:
        if time.time() > deadline:
            raise RuntimeError(f"no stop request reached this rank in {timeout_s} s")
        time.sleep(0.05)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stop-at")
    p.add_argument("--signal-rank", type=int)
    p.add_argument("--push-inside-rounds", action="store_true")
    a, rest = p.parse_known_args()

    def at_point(rank: int) -> None:
        if a.signal_rank is None:
            path = stop_file()
            # the first rank there (a disaggregated placement's engine rank reaches its
            # generation's point alone: the trainers wait for its answer meanwhile)
            if not path.exists():
                request_stop(path, f"stop_in_phase {a.stop_at}")
        elif rank == a.signal_rank:
            os.kill(os.getpid(), signal.SIGUSR1)
        else:
            wait_for_request()

    if a.stop_at:
        install(a.stop_at, at_point)
    if a.push_inside_rounds:
        push_inside_rounds()
    # imported here: the SLURM test's sitecustomize imports this module before runpy runs
    # `-m megatron_rl.cli.train`, which must not find that module imported already
    from megatron_rl.cli import train

    train.main(rest)


if __name__ == "__main__":
    main()
