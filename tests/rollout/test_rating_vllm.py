"""`generate_samples_with_rating` with a real vLLM engine, inline and with a Ray reward pool."""

from __future__ import annotations

import json
import time

import pytest
from transformers import AutoTokenizer

from megatron_rl.data import PromptDataConfig, PromptStream, load_prompts
from megatron_rl.preemption import StepAborted
from megatron_rl.rewards import (
    PythonRewardConfig,
    RewardFailureError,
    ScoringPoolConfig,
    make_scoring_pool,
)
from megatron_rl.rollout.progress import RolloutStopped, load_progress, save_progress
from megatron_rl.rollout.rating import RatingConfig, generate_samples_with_rating
from megatron_rl.rollout.types import EngineWrapper, SamplingConfig

pytestmark = pytest.mark.vllm

SAMPLING = SamplingConfig(n=4, max_new_tokens=24)


def reward(function, **kw):
    return [PythonRewardConfig(path=f"tests.reward_fns:{function}", **kw)]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def dataset(tiny_model_dir, tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "math.jsonl"
    path.write_text(
        "".join(
            json.dumps({"prompt": f"What is {i} + {2 * i}?", "answer": str(3 * i)}) + "\n"
            for i in range(40)
        )
    )
    return load_prompts(PromptDataConfig(path=str(path)), tokenizer)


@pytest.fixture(scope="module")
def engine(vllm_engine):
    return vllm_engine


@pytest.fixture(scope="module")
def ray_session():
    import ray

    ray.init(
        num_cpus=2, object_store_memory=128 * 2**20, include_dashboard=False, logging_level="ERROR"
    )
    yield
    ray.shutdown()


def rollout(dataset, engine, pool, tokenizer, size, seed=None, **cfg):
    return generate_samples_with_rating(
        PromptStream(dataset, seed=1),
        size,
        engine,
        pool,
        SAMPLING,
        tokenizer,
        RatingConfig(**cfg),
        seed=seed,
    )


def test_plain_rollout_is_exact_and_rated(dataset, engine, tokenizer):
    pool = make_scoring_pool(reward("length_parity"))
    out = rollout(dataset, engine, pool, tokenizer, 6, chunk_size=4)
    assert out.metrics["rollout/num_chunks"] == 2 and out.metrics["rollout/prompts_generated"] == 6
    assert len(out.groups) == 6 and all(len(g) == SAMPLING.n for g in out.groups)
    order = [dataset[i].row for i in PromptStream(dataset, seed=1).sampler.take(6)]
    assert [g[0].prompt.row for g in out.groups] == order
    for s in out.samples:
        assert s.response == tokenizer.decode(s.sample.token_ids, skip_special_tokens=True)
        assert s.reward == float(len(s.response) % 2 == 0) == s.scores["python"]
        assert s.sample.prompt_token_ids == s.prompt.prompt_token_ids


def test_a_stop_between_chunks_raises_and_leaves_the_engine_reusable(dataset, engine, tokenizer):
    """`should_stop` is asked before each chunk is generated and before each chunk's scores
    are collected: a yes at the third question (two chunks generated, none collected) raises
    StepAborted naming that point, and the next rollout is the one a fresh call makes."""
    pool = make_scoring_pool(reward("length_parity"))
    asked = []
    stream = PromptStream(dataset, seed=1)
    with pytest.raises(StepAborted) as e:
        generate_samples_with_rating(
            stream, 6, engine, pool, SAMPLING, tokenizer, RatingConfig(chunk_size=2), seed=3,
            should_stop=lambda: asked.append(1) or len(asked) >= 3,
        )  # fmt: skip
    assert e.value.phase == "rollout/score" and len(asked) == 3
    assert stream.state_dict()["index"] == 4  # two chunks of prompts were drawn
    again = rollout(dataset, engine, pool, tokenizer, 6, seed=3, chunk_size=2)
    fresh = rollout(dataset, engine, pool, tokenizer, 6, seed=3, chunk_size=2)
    assert [s.sample.token_ids for s in again.samples] == [
        s.sample.token_ids for s in fresh.samples
    ]


def test_dynamic_filtering_fills_the_batch_with_informative_groups(dataset, engine, tokenizer):
    pool = make_scoring_pool(reward("length_parity"))
    out = rollout(dataset, engine, pool, tokenizer, 6, chunk_size=4, strategy="dynamic_filtering")
    assert len(out.groups) == 6 and out.metrics["rollout/short"] == 0.0
    for g in out.groups:
        assert len({s.reward for s in g}) > 1
    m = out.metrics
    assert m["rollout/groups_kept"] == 6
    assert m["rollout/prompts_generated"] == 4 * m["rollout/num_chunks"] >= 8


def test_dynamic_filtering_stops_at_the_cap(dataset, engine, tokenizer):
    pool = make_scoring_pool(reward("constant"))
    out = rollout(
        dataset,
        engine,
        pool,
        tokenizer,
        4,
        chunk_size=2,
        strategy="dynamic_filtering",
        max_num_gen_chunks=3,
    )
    assert out.groups == []
    assert out.metrics["rollout/num_chunks"] == 3 and out.metrics["rollout/groups_dropped"] == 6
    assert out.metrics["rollout/short"] == 1.0


def test_balance_keeps_as_many_positives_as_negatives(dataset, engine, tokenizer):
    pool = make_scoring_pool(reward("length_parity"))
    out = rollout(
        dataset, engine, pool, tokenizer, 6, strategy="balance", strategy_options={"threshold": 0.5}
    )
    positives = sum(s.reward > 0.5 for s in out.samples)
    assert positives == len(out.samples) - positives > 0
    assert out.metrics["balance/dropped_samples"] == 24 - len(out.samples)


def test_reward_failures_are_contained_until_the_ratio_is_exceeded(dataset, engine, tokenizer):
    pool = make_scoring_pool(reward("fails_on_odd", failure_reward=-5.0))
    out = rollout(dataset, engine, pool, tokenizer, 4, max_failure_ratio=1.0)
    failed = [s for s in out.samples if len(s.response) % 2]
    assert failed and all(s.reward == -5.0 for s in failed)
    assert out.metrics["rollout/reward/python/failures"] == len(failed)
    with pytest.raises(
        RewardFailureError, match=r"'python' failed on \d+/16 samples .*odd response"
    ):
        rollout(dataset, engine, pool, tokenizer, 4, max_failure_ratio=0.05)


def test_unknown_strategy_is_refused(dataset, engine, tokenizer):
    with pytest.raises(ValueError, match="sampling strategy 'dapo'"):
        rollout(
            dataset, engine, make_scoring_pool(reward("constant")), tokenizer, 2, strategy="dapo"
        )


def test_ray_pool_overlaps_scoring_and_matches_inline(engine, dataset, tokenizer, ray_session):
    """Same seed, same samples and ratings; with Ray the engine generates chunk k+1 while
    chunk k is being scored, inline it waits. Per-request seeds make both runs independent
    of what the shared engine generated before (as in the trainer)."""
    fns = reward("slow_length_parity", kwargs={"delay_s": 0.05})
    cfg = dict(chunk_size=3, strategy="dynamic_filtering", max_inflight_chunks=2)
    runs = {}
    for workers in (0, 2):
        pool = make_scoring_pool(fns, ScoringPoolConfig(num_workers=workers))
        runs[workers] = rollout(dataset, engine, pool, tokenizer, 6, seed=11, **cfg)
        pool.close()
    inline, ray_run = runs[0], runs[2]

    def flat(run):
        return [
            (s.prompt.row, s.sample.token_ids, s.sample.logprobs, s.reward, s.scores)
            for s in run.samples
        ]

    assert flat(inline) == flat(ray_run) and len(inline.groups) == 6
    for key in ("rollout/num_chunks", "rollout/groups_dropped", "rollout/reward/mean"):
        assert inline.metrics[key] == ray_run.metrics[key]

    def spans(run, kind):
        return {chunk: (start, end) for k, chunk, start, end in run.timeline if k == kind}

    n = int(ray_run.metrics["rollout/num_chunks"])
    assert n >= 2
    gen, score = spans(ray_run, "generate"), spans(ray_run, "score")
    assert all(gen[k + 1][0] < score[k][1] for k in range(n - 1))  # generation overlapped scoring
    gen, score = spans(inline, "generate"), spans(inline, "score")
    assert all(score[k][1] <= gen[k + 1][0] for k in range(n - 1))  # inline: strictly in turn


def test_ray_worker_that_cannot_build_its_functions_fails_at_start(ray_session):
    with pytest.raises(
        RuntimeError, match="reward workers failed to start.*has no attribute 'nope'"
    ):
        make_scoring_pool(reward("nope"), ScoringPoolConfig(num_workers=1))


def wait_until_dead(actor, timeout_s: float = 60.0) -> None:
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ready.remote(), timeout=5)
        except RayActorError:
            return
        except GetTimeoutError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"Ray actor {actor} still answers {timeout_s} s after ray.kill")


def test_ray_pool_scores_in_process_once_its_workers_are_gone(ray_session, capsys):
    """`scancel` signals Ray's processes too while the trainer finishes its step to save it:
    scoring must still complete (in the trainer's process), once the workers are gone."""
    import ray

    from megatron_rl.rewards.base import RewardInput

    batch = [RewardInput("q", "q", "x" * n) for n in range(1, 9)]
    expected = make_scoring_pool(reward("length_parity")).submit(batch).scored.rewards
    pool = make_scoring_pool(reward("length_parity"), ScoringPoolConfig(num_workers=2))
    try:
        assert pool.result(pool.submit(batch)).scored.rewards == expected
        in_flight = pool.submit(batch)
        for worker in pool.workers:
            ray.kill(worker)  # as a SIGTERM to the worker processes ends them
        # Scored before the kill landed, or in-process after it: the same rewards.
        assert pool.result(in_flight).scored.rewards == expected
        for worker in pool.workers:  # ray.kill returns before the process is gone
            wait_until_dead(worker)
        assert pool.result(pool.submit(batch)).scored.rewards == expected  # in-process now
        assert capsys.readouterr().out.count("the Ray reward workers are gone") == 1
        assert pool.result(pool.submit(batch)).scored.rewards == expected
        assert "workers are gone" not in capsys.readouterr().out  # said once
    finally:
        pool.close()


class Counting(EngineWrapper):
    """The real engine, its calls recorded as (prompts, given partial responses); in call
    `stop_in_call` a stop request comes at the engine's second check (inside generation)."""

    def __init__(self, inner, stop_in_call: int | None = None):
        super().__init__(inner)
        self.calls, self.stop_in_call = [], stop_in_call

    def generate(self, prompts, sampling, seeds=None, should_stop=None, tasks=None,
                 refresh=None, partial=None):  # fmt: skip
        self.calls.append((len(prompts), partial is not None))
        if len(self.calls) == self.stop_in_call:
            checks = []
            should_stop = lambda: checks.append(1) or len(checks) == 2  # noqa: E731
        return self.inner.generate(prompts, sampling, seeds, should_stop, tasks, refresh, partial)


KEPT = SamplingConfig(n=2, max_new_tokens=32, ignore_eos=True)


def kept_rollout(dataset, engine, tokenizer, progress=None, should_stop=None):
    """6 prompts in chunks of 2, `train` step 3 of replica 0 of 1."""
    return generate_samples_with_rating(
        PromptStream(dataset, seed=1), 6, engine, make_scoring_pool(reward("length_parity")),
        KEPT, tokenizer, RatingConfig(chunk_size=2), seed=5, should_stop=should_stop,
        progress=progress, stage="train", step=3,
    )  # fmt: skip


def tokens_of(chunk) -> list[list[int]]:
    return [s.token_ids for s in chunk.samples]


def test_a_rollout_a_stop_cut_is_kept_whole_and_continued_without_a_token_generated_twice(
    dataset, engine, tokenizer, tmp_path
):
    """A stop inside the second chunk's generation: `RolloutStopped` keeps the first chunk
    and the second as far as it got; saved and loaded (the checkpoint's file), the resumed
    rollout takes chunk 0 as it is (no engine call), continues chunk 1's cut responses from
    their tokens and random states and generates chunk 2: every token and reward equals the
    undisturbed rollout's."""
    whole = kept_rollout(dataset, Counting(engine), tokenizer)
    with pytest.raises(RolloutStopped) as stopped:
        kept_rollout(dataset, Counting(engine, stop_in_call=2), tokenizer)
    progress = stopped.value.progress
    assert (stopped.value.phase, progress.stage, progress.step) == ("rollout/generate", "train", 3)
    assert [c.finished for c in progress.chunks] == [True, False] and progress.unfinished == 4
    assert tokens_of(progress.chunks[0]) == tokens_of(whole.progress.chunks[0])
    save_progress(tmp_path, {0: progress})
    assert load_progress(tmp_path) == {0: progress}

    resumed_engine = Counting(engine)
    resumed = kept_rollout(dataset, resumed_engine, tokenizer, load_progress(tmp_path)[0])
    assert resumed_engine.calls == [(2, True), (2, False)]  # chunk 1 continued, chunk 2 new
    assert resumed.metrics["rollout/resumed_tokens"] == progress.tokens > 0
    chunks = resumed.progress.chunks
    for s, cut in zip(chunks[1].samples, progress.chunks[1].samples, strict=True):
        assert s.token_ids[: len(cut.token_ids)] == cut.token_ids and len(s.token_ids) == 32
    assert [tokens_of(c) for c in chunks] == [tokens_of(c) for c in whole.progress.chunks]
    assert [s.reward for s in resumed.samples] == [s.reward for s in whole.samples]
    assert len(resumed.samples) == 12


def test_a_stop_during_scoring_keeps_every_chunk_generated_and_the_resume_scores_them(
    dataset, engine, tokenizer
):
    """A stop at the third question (two chunks generated, none scored): both are kept
    whole; the resumed rollout calls the engine for the third chunk only and equals the
    undisturbed one, scores included."""
    whole = kept_rollout(dataset, Counting(engine), tokenizer)
    asked = []
    with pytest.raises(RolloutStopped) as stopped:
        kept_rollout(dataset, Counting(engine), tokenizer,
                     should_stop=lambda: asked.append(1) or len(asked) >= 3)  # fmt: skip
    progress = stopped.value.progress
    assert stopped.value.phase == "rollout/score"
    assert [c.finished for c in progress.chunks] == [True, True]
    resumed_engine = Counting(engine)
    resumed = kept_rollout(dataset, resumed_engine, tokenizer, progress)
    assert resumed_engine.calls == [(2, False)]
    assert [(s.sample.token_ids, s.reward) for s in resumed.samples] == [
        (s.sample.token_ids, s.reward) for s in whole.samples
    ]


def test_progress_saved_by_another_run_config_is_refused_by_name(dataset, engine, tokenizer):
    asked = []
    with pytest.raises(RolloutStopped) as stopped:
        kept_rollout(dataset, Counting(engine), tokenizer,
                     should_stop=lambda: asked.append(1) or len(asked) >= 3)  # fmt: skip
    progress = stopped.value.progress
    progress.chunks[1].rows = [r + 1 for r in progress.chunks[1].rows]
    with pytest.raises(ValueError, match=r"chunk 1 drew prompt rows .* remove rollout_progress/"):
        kept_rollout(dataset, Counting(engine), tokenizer, progress)
