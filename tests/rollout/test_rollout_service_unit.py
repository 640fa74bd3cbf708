"""Unit tier: the two rollout services (`rollout/service/service.py`) give the trainer the
same answers: the rollout, an abort that leaves the prompt stream where it was, the
staleness of a remote round (checked against async.max_staleness), weight pushes that a
local engine skips when nothing changed and the engine ranks always count."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_rl.config import TrainConfig
from megatron_rl.config.loader import from_dict
from megatron_rl.rollout.progress import GeneratedChunk, RolloutProgress, save_progress
from megatron_rl.rollout.service.service import LocalRollout, RemoteRollout
from megatron_rl.rollout.types import UNFINISHED, Sample, SamplingConfig


class _Prompts:
    def __init__(self):
        self.position = {"epoch": 0, "index": 4}

    def state_dict(self):
        return dict(self.position)

    def load_state_dict(self, state):
        self.position = dict(state)


class _EngineRanks:
    """`EngineRanks`' answers: (groups, metrics, data position, aborted phase, version,
    every replica's progress)."""

    is_source = True  # trainer rank 0

    def __init__(self, version=0, aborted=None):
        self.version, self.aborted, self.asked, self.pushed = version, aborted, [], []

    def round(self, step, end, data, saved):
        self.asked.append(("round", step, end, data, saved))
        return self.answer(data)

    def generate(self, stage, step, data, saved):
        self.asked.append((stage, step, data, saved))
        return self.answer(data)

    def answer(self, data):
        drawn = {"epoch": 0, "index": data["index"] + 2}
        return ["g"], {"m": 1.0}, drawn, self.aborted, self.version, {0: "progress"}

    def push(self, actor, version, evaluate_step):
        self.pushed.append((version, evaluate_step))
        return None if evaluate_step is None else ["sums"]

    def evaluate(self, step):
        return [f"sums at {step}"]


def config(max_staleness=1, total_steps=5) -> TrainConfig:
    return from_dict(
        TrainConfig,
        {"async": {"max_staleness": max_staleness}, "trainer": {"total_steps": total_steps}},
    )


class _Evaluator:
    def __bool__(self):
        return True

    def summarize(self, sums):
        return {"eval/sums": sums}, []


def remote(ranks, **kw) -> RemoteRollout:
    return RemoteRollout(config(**kw), ranks, _Evaluator(), SimpleNamespace(close=lambda: None))


def test_a_remote_round_moves_the_prompts_to_the_engines_draws_and_says_its_staleness():
    ranks, prompts = _EngineRanks(version=2), _Prompts()
    got = remote(ranks).generate("train", 3, prompts)
    assert (got.groups, got.aborted) == (["g"], None)
    assert got.metrics == {"m": 1.0, "rollout/staleness": 1.0}
    assert ranks.asked == [("round", 3, 5, {"epoch": 0, "index": 4}, {})]
    assert prompts.position == {"epoch": 0, "index": 6}
    assert got.progress == {0: "progress"}  # kept until the step ends


def test_the_progress_a_stop_kept_goes_to_the_engines_with_the_first_round_only(tmp_path):
    kept = RolloutProgress(
        "train", 0, 2, SamplingConfig(n=1),
        [GeneratedChunk([4], [Sample(0, 0, [1, 2], [3], [-0.5], UNFINISHED)])],
    )  # fmt: skip
    save_progress(tmp_path, {1: kept})
    ranks = _EngineRanks()
    rollout = remote(ranks)
    rollout.resume_progress(tmp_path)
    rollout.generate("train", 0, _Prompts())
    rollout.generate("train", 1, _Prompts())
    assert [asked[-1] for asked in ranks.asked] == [{1: kept}, {}]


def test_value_pretraining_asks_for_one_round_with_no_staleness():
    ranks, prompts = _EngineRanks(), _Prompts()
    got = remote(ranks).generate("value_pretrain", 0, prompts)
    assert got.metrics == {"m": 1.0} and ranks.asked[0][0] == "value_pretrain"


def test_an_aborted_remote_round_leaves_the_prompts_and_names_the_phase():
    prompts = _Prompts()
    got = remote(_EngineRanks(aborted="rollout/generate")).generate("train", 0, prompts)
    assert (got.groups, got.metrics, got.aborted) == ([], {}, "rollout/generate")
    assert prompts.position == {"epoch": 0, "index": 4}
    assert got.progress == {0: "progress"}  # what the engines generated before the stop


def test_a_round_staler_than_the_bound_is_a_bug_said_as_such():
    with pytest.raises(RuntimeError, match=r"staleness 2 outside \[0, async.max_staleness=1\]"):
        remote(_EngineRanks(version=1)).generate("train", 3, _Prompts())


def test_the_engine_ranks_get_every_version_and_evaluate_right_after_the_push_asked():
    ranks = _EngineRanks()
    service = remote(ranks)
    service.push_weights("actor", 1, changed=False)
    service.push_weights("actor", 2, evaluate=True)
    assert ranks.pushed == [(1, None), (2, 2)]
    assert service.evaluate(2)[0] == {"eval/sums": ["sums"]}  # made right after the push
    assert service.evaluate(3)[0] == {"eval/sums": ["sums at 3"]}  # asked for now
    assert (service.awake, service.memory_state()) == ((), "apart")


class _Engine:
    def __init__(self):
        self.awake, self.calls = {"weights", "kv_cache"}, []

    def sleep(self, level):
        self.calls.append(("sleep", level))
        self.awake = set()

    def wake_up(self, tags):
        self.calls.append(("wake_up", tags))
        self.awake |= set(tags)


def test_a_local_engine_sleeps_wakes_after_the_allocator_released_and_skips_unchanged_pushes(
    monkeypatch,
):
    from megatron_rl.rollout.service import service as module

    synced, released = [], []
    monkeypatch.setattr(module, "sync_weights", lambda actor, engine: synced.append(actor))
    engine = _Engine()
    local = LocalRollout(config(), engine, None, None, None, _Evaluator(), None, 0, 1,
                         released.append)  # fmt: skip
    local.push_weights("actor", 1, changed=False)
    local.push_weights("actor", 2)
    assert synced == ["actor"]
    assert local.awake == ("weights", "kv_cache") and local.memory_state() == "kv_cache+weights"
    local.sleep(2)
    assert (local.awake, local.memory_state()) == ((), "asleep")
    local.wake_up(("weights",), why="save_")
    assert released == ["save_wake_weights"] and engine.calls[-1] == ("wake_up", ("weights",))
