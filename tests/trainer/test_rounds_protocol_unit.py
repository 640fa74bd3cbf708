"""Unit tier: the disaggregated placement's protocol (`trainer/disaggregated.py`,
`trainer/engine_worker.py`) run as written, both sides: the trainers' `EngineRanks` against
one `EngineWorker` loop per engine replica, each in a thread, joined by channels where a
send waits for its receive, as a gloo send does. Generation, weights and the trainers' own
collectives are replaced (their tests are the distributed ones); what runs is the real
order of commands and answers, the admission rule and its mirror (`RoundsInFlight`).

A protocol bug shows as a send nobody receives: the channel times out and the test fails
instead of hanging."""

from __future__ import annotations

import queue
import threading
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.trainer import disaggregated, engine_worker
from megatron_rl.trainer.disaggregated import EngineRanks, Rated, RoundsInFlight
from megatron_rl.trainer.engine_worker import EngineWorker

TIMEOUT_S = 10.0


class Channel:
    """One direction between two threads: `send` returns once `recv` took the object."""

    def __init__(self):
        self.q = queue.Queue()

    def send(self, obj) -> None:
        taken = threading.Event()
        self.q.put((obj, taken))
        if not taken.wait(TIMEOUT_S):
            raise TimeoutError(f"nobody received {obj!r}")

    def recv(self):
        try:
            obj, taken = self.q.get(timeout=TIMEOUT_S)
        except queue.Empty:
            raise TimeoutError("nothing was sent") from None
        taken.set()
        return obj


class Engine(EngineWorker):
    """An engine replica whose rounds are labels and whose weights are a version number."""

    def __init__(self, replica: int, replicas: int, abort_round: int | None):
        self.replica, self.replicas, self.version = replica, replicas, 0
        self.stream = self.bridge = None  # the channels below stand in for both groups
        self.leader, self.replica_group = True, None  # one rank per replica here
        self.to_engine, self.to_trainer = Channel(), Channel()
        self.abort_round = abort_round
        self.generated: list[tuple[int, int]] = []  # (round, version)
        self.prompts = SimpleNamespace(load_state_dict=lambda state: None)
        self.evaluator = SimpleNamespace(local_sums=lambda step: [torch.tensor([float(step)])])

    def generate(self, stage, step):
        self.generated.append((step, self.version))
        aborted = "rollout/generate" if step == self.abort_round else None
        groups = [] if aborted else [f"r{step}e{self.replica}"]
        return Rated(self.replica, groups, {"m": 1.0}, {"epoch": 0, "index": step}, aborted,
                     step, self.version)  # fmt: skip

    def load_weights(self):
        self.version = self.to_engine.recv()


def run_protocol(monkeypatch, replicas, max_staleness, start, end, abort_round=None,
                 stop_after_round=None, evaluate_at=()):  # fmt: skip
    """The trainers' loop of `RLTrainer` (round, then a push after the update, evaluating
    where due) from step `start` to `end`; a stop request aborts the step whose round comes
    back aborted, or (`stop_after_round`) the step whose round was just taken. Returns the
    steps' (staleness, groups), the eval sums and the engines."""
    engines = [Engine(e, replicas, abort_round) for e in range(replicas)]
    current = threading.local()  # which engine a thread is

    def engine_broadcast(group, obj, root):
        return current.engine.to_engine.recv()

    def engine_send(group, obj, dst):
        current.engine.to_trainer.send(obj)

    def trainer_broadcast(group, obj, root):
        for engine in engines:
            engine.to_engine.send(obj)
        return obj

    def trainer_push(group, tensors, version, bucket_bytes):
        for engine in engines:
            engine.to_engine.send(version)

    monkeypatch.setattr(engine_worker, "broadcast_object", engine_broadcast)
    monkeypatch.setattr(engine_worker, "send_object", engine_send)
    monkeypatch.setattr(disaggregated, "broadcast_object", trainer_broadcast)
    monkeypatch.setattr(disaggregated, "push_weights", trainer_push)
    monkeypatch.setattr(
        disaggregated, "recv_object", lambda group, src: engines[src - 1].to_trainer.recv()
    )
    monkeypatch.setattr(disaggregated, "all_stage_tensors", lambda *args: iter(()))
    # one trainer rank: its own collectives hand over what it has
    monkeypatch.setattr(torch.distributed, "scatter_object_list", lambda out, inp, src: out.__setitem__(0, inp[0]))  # fmt: skip
    monkeypatch.setattr(torch.distributed, "broadcast_object_list", lambda objs, src: None)

    ranks = EngineRanks.__new__(EngineRanks)
    ranks.placement = SimpleNamespace(engine_ranks=replicas)
    ranks.ctx = SimpleNamespace(dp_rank=0, dp_size=1, rank=0, world_size=1)
    ranks.max_staleness, ranks.dp_ranks, ranks.bucket_bytes = max_staleness, [0], 1
    ranks.engine_tp = 1
    ranks.stream = ranks.bridge = object()
    ranks.version, ranks.rounds, ranks.pending = start, None, {}
    for engine in engines:
        engine.version = start  # the weights a resume pushed

    errors = []

    def serve(engine):
        current.engine = engine
        try:
            engine.run()
        except Exception as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=serve, args=(e,), daemon=True) for e in engines]
    for t in threads:
        t.start()
    steps, evals = [], {}
    actor = SimpleNamespace(chunks=None, arch=None)
    for step in range(start, end):
        groups, _, _, aborted, version = ranks.round(step, end, {"epoch": 0, "index": step})
        steps.append((step - version, groups))
        if aborted or step == stop_after_round:
            break
        sums = ranks.push(actor, step + 1, step + 1 if step + 1 in evaluate_at else None)
        if sums is not None:
            evals[step + 1] = [s.item() for s in sums]
    ranks.shutdown()
    for t in threads:
        t.join(TIMEOUT_S)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "an engine never saw Shutdown"
    return steps, evals, engines


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("start", [0, 3])
def test_synchronous_rounds_are_generated_with_the_weights_they_train(monkeypatch, replicas, start):
    steps, evals, engines = run_protocol(
        monkeypatch, replicas, 0, start, start + 4, evaluate_at={start + 2, start + 4}
    )
    assert [lag for lag, _ in steps] == [0] * 4
    assert [groups for _, groups in steps][0] == [f"r{start}e{e}" for e in range(replicas)]
    for engine in engines:
        assert engine.generated == [(s, s) for s in range(start, start + 4)]
    # evaluated with the weights just pushed, summed over the replicas
    assert evals == {start + 2: [(start + 2.0) * replicas], start + 4: [(start + 4.0) * replicas]}


@pytest.mark.parametrize("replicas", [1, 2])
def test_one_step_off_rounds_run_one_version_behind_and_never_more(monkeypatch, replicas):
    steps, evals, engines = run_protocol(monkeypatch, replicas, 1, 0, 5, evaluate_at={2, 5})
    assert [lag for lag, _ in steps] == [0, 1, 1, 1, 1]
    for engine in engines:
        # round 0 with the starting weights, round s with those after s - 1 updates
        assert engine.generated == [(0, 0), (1, 0), (2, 1), (3, 2), (4, 3)]
    assert evals == {2: [2.0 * replicas], 5: [5.0 * replicas]}


@pytest.mark.parametrize("max_staleness", [0, 1])
@pytest.mark.parametrize("abort_round", [0, 2])
def test_an_aborted_round_ends_the_steps_and_every_engine_leaves(
    monkeypatch, max_staleness, abort_round
):
    steps, _, engines = run_protocol(monkeypatch, 2, max_staleness, 0, 4, abort_round=abort_round)
    assert len(steps) == abort_round + 1 and steps[-1][1] == []
    for engine in engines:
        assert engine.generated[-1][0] == abort_round


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_a_stop_in_the_trainers_phases_drains_the_round_ahead_before_shutting_down(
    monkeypatch, max_staleness
):
    """The trainers abort step 2 after its rollout (the engines, at max_staleness 1, are
    generating step 3's meanwhile: it is received and dropped, so no engine is left in a
    send when Shutdown is broadcast)."""
    steps, _, engines = run_protocol(monkeypatch, 2, max_staleness, 0, 5, stop_after_round=2)
    assert len(steps) == 3
    for engine in engines:
        assert [r for r, _ in engine.generated] == list(range(3 + max_staleness))


def test_rounds_in_flight_follow_the_admission_rule():
    rounds = RoundsInFlight.starting(step=4, end=7, max_staleness=1, replicas=2)
    assert rounds.due(0, version=4) and rounds.due(1, version=3)
    rounds.answered(0, aborted=False)
    rounds.answered(0, aborted=False)  # rounds 4 and 5
    assert not rounds.due(0, version=4)  # round 6 needs version 5
    assert rounds.due(0, version=5)
    rounds.answered(1, aborted=True)
    assert not rounds.due(1, version=9)  # stopped after an aborted round
    rounds.answered(0, aborted=False)
    assert not rounds.due(0, version=9)  # past the end
