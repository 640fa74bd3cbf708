"""Unit tier: the disaggregated placement's protocol (`rollout/service/protocol.py`,
`rollout/service/engine_worker.py`) run as written, both sides: the trainers' `EngineRanks` against
one `EngineWorker` loop per engine replica, each in a thread, joined by channels where a
send waits for its receive, as a gloo send does. Generation, weights and the trainers' own
collectives are replaced (their tests are the distributed ones); what runs is the real
order of commands and answers: the doorbell, `Ready`, the admission rule, and partial
rollouts' reads of a command inside a round (`EngineWorker.load`).

A protocol bug shows as a send nobody receives: the channel times out and the test fails
instead of hanging."""

from __future__ import annotations

import queue
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.rollout.service import engine_worker, protocol
from megatron_rl.rollout.service.engine_worker import EngineWorker
from megatron_rl.rollout.service.protocol import DOORBELL_KEY, EngineRanks, Rated

TIMEOUT_S = 10.0


class Channel:
    """One direction between two threads: `send` returns once `recv` took the object, as a
    gloo send does; `post` at once, returning what waits for that (`post_object`)."""

    def __init__(self):
        self.q = queue.Queue()

    def send(self, obj) -> None:
        self.post(obj).wait()

    def post(self, obj) -> SimpleNamespace:
        taken = threading.Event()
        self.q.put((obj, taken))

        def wait() -> None:
            if not taken.wait(TIMEOUT_S):
                raise TimeoutError(f"nobody received {obj!r}")

        return SimpleNamespace(wait=wait)

    def recv(self):
        try:
            obj, taken = self.q.get(timeout=TIMEOUT_S)
        except queue.Empty:
            raise TimeoutError("nothing was sent") from None
        taken.set()
        return obj


class Store:
    """The job's store, as far as the doorbell uses it: an atomic counter."""

    def __init__(self):
        self.lock, self.counts = threading.Lock(), {}

    def add(self, key: str, n: int) -> int:
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + n
            return self.counts[key]


class Engine(EngineWorker):
    """An engine replica whose rounds are labels and whose weights are a version number.
    With `partial_rollout`, round r > the first goes on until the weights of version r reach
    it inside the round (as a long generation would), asking at each check as vLLM does."""

    def __init__(self, replica, replicas, abort_round, store, partial_rollout=False):
        self.replica, self.replicas, self.version = replica, replicas, 0
        self.stream = self.bridge = None  # the channels below stand in for both groups
        self.leader, self.replica_group = True, None  # one rank per replica here
        self.store, self.commands_read, self.partial_rollout = store, 0, partial_rollout
        self.posted, self.interleave = [], False  # interleaving: the test at the end
        self.to_engine, self.to_trainer = Channel(), Channel()
        self.abort_round = abort_round
        self.generated: list[tuple[int, int]] = []  # (round, version it started with)
        self.segments: dict[int, list[int]] = {}  # round -> the versions it ran under
        self.first_round = None
        self.saved_seen = {}  # round -> the saved progress it was given
        self.prompts = SimpleNamespace(load_state_dict=lambda state: None)
        self.evaluator = SimpleNamespace(local_sums=lambda step: [torch.tensor([float(step)])])

    def rounds(self, command):
        self.first_round = command.step
        return super().rounds(command)

    def generate(self, stage, step, saved):
        self.saved_seen[step] = saved
        head = self.version
        self.generated.append((step, head))
        self.segments[step] = [head]
        if self.partial_rollout and step > self.first_round:
            deadline = time.monotonic() + TIMEOUT_S
            while self.version < step:  # until the push after step - 1's update reached it
                if self.pending():  # `VLLMEngine._generate_resumable`'s check
                    version = self.load()
                    if version != self.segments[step][-1]:
                        self.segments[step].append(version)
                elif time.monotonic() > deadline:
                    raise TimeoutError(f"round {step}: no weights came while it ran")
                time.sleep(0.001)
        aborted = "rollout/generate" if step == self.abort_round else None
        groups = [] if aborted else [f"r{step}e{self.replica}"]
        return Rated(self.replica, groups, {"m": 1.0}, {"epoch": 0, "index": step}, aborted,
                     step, head, f"p{step}e{self.replica}")  # fmt: skip

    def load_weights(self):
        self.version = self.to_engine.recv()


def run_protocol(monkeypatch, replicas, max_staleness, start, end, abort_round=None,
                 stop_after_round=None, evaluate_at=(), partial_rollout=False,
                 saved=None):  # fmt: skip
    """The trainers' loop of `RLTrainer` (round, then a push after the update, evaluating
    where due) from step `start` to `end`, resumed with `saved` progress; a stop request
    aborts the step whose round comes back aborted, or (`stop_after_round`) the step whose
    round was just taken. Returns the steps' (staleness, groups), the eval sums and the
    engines; each step's progress kept on rank 0 in `engines[0].kept`."""
    store = Store()
    engines = [Engine(e, replicas, abort_round, store, partial_rollout) for e in range(replicas)]
    current = threading.local()  # which engine a thread is

    def engine_broadcast(group, obj, root):
        return current.engine.to_engine.recv()

    def engine_post(group, obj, dst):
        return current.engine.to_trainer.post(obj)

    def trainer_broadcast(group, obj, root):
        for engine in engines:
            engine.to_engine.send(obj)
        return obj

    def trainer_push(group, tensors, version, bucket_bytes):
        for engine in engines:
            engine.to_engine.send(version)

    monkeypatch.setattr(engine_worker, "broadcast_object", engine_broadcast)
    monkeypatch.setattr(engine_worker, "post_object", engine_post)
    monkeypatch.setattr(protocol, "broadcast_object", trainer_broadcast)
    monkeypatch.setattr(protocol, "push_weights", trainer_push)
    monkeypatch.setattr(
        protocol, "recv_object", lambda group, src: engines[src - 1].to_trainer.recv()
    )
    monkeypatch.setattr(protocol, "all_stage_tensors", lambda *args: iter(()))
    # one trainer rank: its own collectives hand over what it has
    monkeypatch.setattr(torch.distributed, "scatter_object_list", lambda out, inp, src: out.__setitem__(0, inp[0]))  # fmt: skip
    monkeypatch.setattr(torch.distributed, "broadcast_object_list", lambda objs, src: None)

    ranks = EngineRanks.__new__(EngineRanks)
    ranks.placement = SimpleNamespace(engine_ranks=replicas)
    ranks.ctx = SimpleNamespace(dp_rank=0, dp_size=1, rank=0, world_size=1)
    ranks.max_staleness, ranks.dp_ranks, ranks.bucket_bytes = max_staleness, [0], 1
    ranks.engine_tp = 1
    ranks.stream = ranks.bridge = object()
    ranks.version, ranks.rounds_started, ranks.pending, ranks.store = start, False, {}, store
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
    steps, evals, kept = [], {}, {}
    actor = SimpleNamespace(chunks=None, arch=None)
    for step in range(start, end):
        data = {"epoch": 0, "index": step}
        groups, _, _, aborted, version, kept[step] = ranks.round(step, end, data, saved or {})
        steps.append((step - version, groups))
        if partial_rollout and step + 1 < end:  # the next command comes inside the next round
            deadline = time.monotonic() + TIMEOUT_S
            while any(len(e.generated) < step + 2 - start for e in engines):
                assert time.monotonic() < deadline, f"no engine started round {step + 1}"
                time.sleep(0.001)
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
    # every command was one ring and one Ready from each replica
    assert all(e.commands_read == store.counts[DOORBELL_KEY] for e in engines)
    engines[0].kept = kept
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


@pytest.mark.parametrize("replicas", [1, 2])
def test_answers_do_not_wait_to_be_received_so_engines_run_max_staleness_rounds_ahead(
    monkeypatch, replicas
):
    """At max_staleness 2 (partial rollouts off, as only this test can: the rounds here are
    instant) the engines generate rounds 0-2 with the starting weights before the trainers
    take round 0, since their answers are posted, not waited for; from then each round is
    two updates behind the step that trains it, never more."""
    steps, evals, engines = run_protocol(monkeypatch, replicas, 2, 0, 5, evaluate_at={2, 5})
    assert [lag for lag, _ in steps] == [0, 1, 2, 2, 2]
    for engine in engines:
        assert engine.generated == [(0, 0), (1, 0), (2, 0), (3, 1), (4, 2)]
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
    # what each replica generated of the aborted round reaches trainer rank 0
    assert engines[0].kept[abort_round] == {0: f"p{abort_round}e0", 1: f"p{abort_round}e1"}


def test_the_progress_a_stop_kept_goes_with_the_first_round_to_every_replica(monkeypatch):
    saved = {0: "kept by replica 0", 1: "kept by replica 1"}
    _, _, engines = run_protocol(monkeypatch, 2, 1, 3, 6, saved=saved)
    for engine in engines:
        assert engine.saved_seen[3] == saved  # each replica takes its own (`progress_for`)


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


@pytest.mark.parametrize("max_staleness", [1, 2])
@pytest.mark.parametrize("replicas", [1, 2])
def test_partial_rollouts_take_each_push_inside_the_round_and_go_on(
    monkeypatch, replicas, max_staleness
):
    """With partial rollouts every round after the first is still running when the next
    push comes (as a long generation would): the engines read the push inside it and
    finish it under the new weights; a round started under version v is then trained at step
    v + 1 (staleness 1, never more than max_staleness); evaluations and the final Shutdown
    are read inside rounds too, and nothing is left unreceived."""
    steps, evals, engines = run_protocol(
        monkeypatch, replicas, max_staleness, 0, 5, evaluate_at={2, 5}, partial_rollout=True
    )
    assert [lag for lag, _ in steps] == [0, 1, 1, 1, 1]
    for engine in engines:
        assert engine.generated[:5] == [(0, 0), (1, 0), (2, 1), (3, 2), (4, 3)]
        # each round from 1 on switched to the next version inside it
        assert [engine.segments[r] for r in range(1, 5)] == [[0, 1], [1, 2], [2, 3], [3, 4]]
        # round 5 does not exist (end = 5): the engines left at Shutdown
        assert len(engine.generated) == 5
    assert evals == {2: [2.0 * replicas], 5: [5.0 * replicas]}


def test_a_stop_with_partial_rollouts_ends_a_round_in_flight_at_shutdown(monkeypatch):
    """A stop after step 1's rollout: step 2's round is running (it waits for weights that
    never come); Shutdown, rung like any command, is read inside it and unwinds it."""
    steps, _, engines = run_protocol(
        monkeypatch, 2, 1, 0, 5, stop_after_round=1, partial_rollout=True
    )
    assert len(steps) == 2
    for engine in engines:
        assert engine.generated == [(0, 0), (1, 0), (2, 1)] and engine.segments[2] == [1]


def test_the_next_round_is_named_once_the_version_held_admits_it():
    """`EngineWorker.next_round` (rounds interleaved): round s + 1 is named while round s
    generates once the engine holds version >= s + 1 - max_staleness, once, never past the
    run's end; its prompts are this replica's share of the stream's next draw (the stream is
    put back: the round draws them itself) and its seeds those of that round's first engine
    call (`generate_samples_with_rating`)."""
    from megatron_rl.data import PromptStream
    from megatron_rl.rollout.rating import chunk_seeds
    from megatron_rl.rollout.service.protocol import Rounds
    from megatron_rl.rollout.service.rounds import DataParallelShard, round_seed

    w = EngineWorker.__new__(EngineWorker)
    w.config = SimpleNamespace(
        rollout=SimpleNamespace(rollout_batch_size=4), trainer=SimpleNamespace(seed=5)
    )
    w.replica, w.replicas, w.interleave, w.admitted = 1, 2, True, {}
    w.prompts = PromptStream([SimpleNamespace(row=i, prompt_token_ids=[i, 1]) for i in range(9)])
    w.prompts.take(4)  # round 1's draw
    w.run_of_rounds, w.step, w.version = Rounds(1, 3, {}, max_staleness=1), 1, 0
    assert w.next_round() is None  # round 2 needs version 1
    w.version = 1
    at = w.prompts.state_dict()
    prompts, seeds = w.next_round()
    assert w.prompts.state_dict() == at
    batch = DataParallelShard(w.prompts, 1, 2).take(2)  # what round 2 draws (the wrap included)
    assert prompts == [p.prompt_token_ids for p in batch] and len(prompts) == 2
    assert seeds == chunk_seeds(round_seed(w.config, "train", 2), batch, chunk=0)
    assert w.admitted == {2: 1}  # round 2's head version
    assert w.next_round() is None  # named once
    w.step = 2
    assert w.next_round() is None  # round 2 is the run's last
    w.step, w.admitted, w.interleave = 1, {}, False
    assert w.next_round() is None  # a filtering strategy or several chunks: not interleaved
