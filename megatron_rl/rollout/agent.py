"""Multi-turn rollouts with tools: the policy generates until a tool call, the environment
answers, the answer's tokens are appended, and the policy goes on (#47).

Token in, token out: a trajectory is the prompt's ids, then each turn's ids as the engine
sampled them, then each answer's block encoded once, alone, and appended as it is. Nothing
is decoded to be encoded again, so the trainer reads exactly the ids the engine saw and
sampled (re-rendering the conversation after each turn can give other ids, which verl and
others found silently biases the loss). Decoding happens only to read: the environment
reads a turn's text to find the call.

`run_turns` is the turn-synchronous loop (NeMo-RL's `run_multi_turn_rollout`): turn k of
every active trajectory in engine calls, then their environment steps on the pool (at
`num_workers` at once), then turn k + 1. It works with any engine that has
`generate(prompts, sampling, seeds, should_stop)`. Dataflow of one turn: continuation
prompts (prompt + tokens so far) -> `engine.generate` (grouped by the tokens each may still
draw) -> per trajectory: the call parsed, a step submitted -> `pool.poll` until every step
answered (the stop request asked between polls) -> answers appended or the trajectory ended.

Limits (verl's names): `max_turns` policy turns; `max_response_length` tokens after the
prompt, policy and environment together; a turn draws at most `max_new_tokens`. An answer
whose block would not fit ends the trajectory before it is appended, so a trajectory always
ends on a policy token, where its outcome reward lands. Continuations are seeded with
`continuation_seed` (the partial rollouts' rule), so a rerun draws the same tokens.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from megatron_rl.envs.base import Action, StepResult, Task
from megatron_rl.preemption import StepAborted
from megatron_rl.rollout.tool_formats import ToolFormat, TruncateSide, truncate
from megatron_rl.rollout.vllm_engine import Sample, SamplingConfig, continuation_seed

POLL_S = 0.1
"""Longest wait on the pool between two asks of the stop request."""


@dataclass(frozen=True)
class AgentSpec:
    """What the loop needs besides the engine: the format, its stop token and the limits."""

    format: ToolFormat
    call_end_id: int
    """The token id of `format.call_end` in the policy's tokenizer (`call_end_id`)."""
    max_turns: int
    max_response_length: int
    max_tool_response_length: int = 256
    truncate_side: TruncateSide = "middle"

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if self.max_response_length < 1:
            raise ValueError(f"max_response_length must be >= 1, got {self.max_response_length}")


@dataclass
class Trajectory:
    """One sample being generated over turns."""

    prompt_index: int
    sample_index: int
    prompt: list[int]
    task: Task
    seed: int | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    env_spans: list[tuple[int, int]] = field(default_factory=list)
    step_rewards: list[tuple[int, float]] = field(default_factory=list)
    turns: int = 0
    state: object = None
    finish_reason: str | None = None
    last_ended_by: str = "eos"

    @property
    def key(self) -> tuple[int, int]:
        return self.prompt_index, self.sample_index

    def sample(self) -> Sample:
        return Sample(
            self.prompt_index, self.sample_index, self.prompt, self.tokens, self.logprobs,
            self.finish_reason or "stop", env_spans=self.env_spans,
            step_rewards=self.step_rewards,
        )  # fmt: skip


@dataclass
class AgentStats:
    """Counts of one rollout, for the `rollout/multi_turn/*` and `tool/*` metrics."""

    turns: list[int] = field(default_factory=list)
    env_tokens: int = 0
    policy_tokens: int = 0
    tool_status: Counter = field(default_factory=Counter)
    finish: Counter = field(default_factory=Counter)

    def metrics(self) -> dict[str, float]:
        n = max(len(self.turns), 1)
        calls = sum(self.tool_status.values())
        out = {
            "rollout/multi_turn/turns/mean": sum(self.turns) / n,
            "rollout/multi_turn/env_tokens/mean": self.env_tokens / n,
            "rollout/multi_turn/policy_tokens/mean": self.policy_tokens / n,
            "rollout/multi_turn/tool_calls/mean": calls / n,
        }
        out.update({f"rollout/finish/{k}": v / n for k, v in sorted(self.finish.items())})
        out.update(
            {f"tool/{k}_rate": v / max(calls, 1) for k, v in sorted(self.tool_status.items())}
        )
        return out


def run_turns(
    engine,
    prompts: list[list[int]],
    tasks: list[Task],
    sampling: SamplingConfig,
    seeds: list[int] | None,
    spec: AgentSpec,
    pool,
    tokenizer,
    should_stop: Callable[[], bool] | None = None,
) -> tuple[list[Sample], AgentStats]:
    """`sampling.n` multi-turn samples per prompt, prompt-major as `engine.generate`'s, and
    the rollout's counts. `pool`: an `EnvPool`; `tokenizer`: the policy's (decodes turns to
    read calls, encodes answers once). `should_stop` is asked by the engine and between
    pool polls; yes cancels the pool's steps and raises `StepAborted("rollout/tools")`."""
    stats = AgentStats()
    trajectories = [
        Trajectory(i, j, list(p), tasks[i], None if seeds is None else seeds[i])
        for i, p in enumerate(prompts)
        for j in range(sampling.n)
    ]
    _reset(trajectories, pool, tokenizer, spec, should_stop)
    sampling = replace(sampling, stop_token_ids=(*sampling.stop_token_ids, spec.call_end_id))
    active = [t for t in trajectories if t.finish_reason is None]
    while active:
        _generate_turn(engine, active, sampling, spec, should_stop)
        stepping = [t for t in active if _wants_step(t, spec)]
        answers = _steps(stepping, pool, tokenizer, spec, should_stop)
        for t in stepping:
            _apply(t, answers[t.key], tokenizer, spec, stats)
        active = [t for t in active if t.finish_reason is None]
    for t in trajectories:
        stats.turns.append(t.turns)
        stats.env_tokens += sum(b - a for a, b in t.env_spans)
        stats.policy_tokens += len(t.tokens) - sum(b - a for a, b in t.env_spans)
        stats.finish[t.finish_reason] += 1
    return [t.sample() for t in trajectories], stats


def _reset(trajectories, pool, tokenizer, spec, should_stop) -> None:
    """Each prompt's first state, shared by its samples (one task, one reset); a first
    observation joins the prompt (context, never trained on, as the prompt is)."""
    tasks = {t.prompt_index: t.task for t in trajectories}
    outcomes = _await(pool, {i: ("reset", task) for i, task in tasks.items()}, should_stop)
    for i, reset in outcomes.items():
        if not hasattr(reset, "state"):  # EnvFailure: the trajectory cannot start
            raise RuntimeError(
                f"environment reset of prompt {i} failed ({reset.status}): {reset.message}"
            )
    for t in trajectories:
        reset = outcomes[t.prompt_index]
        t.state = reset.state
        if reset.observation is not None:
            text = _answer_text(reset.observation, spec)
            t.prompt = t.prompt + tokenizer.encode(text, add_special_tokens=False)


def _generate_turn(engine, active, sampling, spec, should_stop) -> None:
    """One policy turn of every active trajectory: turn 0 as one ordinary `generate` call
    (the prompt's `n` samples, its seed), later turns one request per trajectory, grouped by
    how many tokens each may still draw."""
    first = [t for t in active if t.turns == 0]
    later = [t for t in active if t.turns > 0]
    if first:
        prompts = sorted({t.prompt_index: t.prompt for t in first}.items())
        seeds = None if first[0].seed is None else [
            next(t.seed for t in first if t.prompt_index == i) for i, _ in prompts
        ]  # fmt: skip
        turn = replace(sampling, max_new_tokens=min(sampling.max_new_tokens,
                                                    spec.max_response_length))  # fmt: skip
        out = engine.generate([p for _, p in prompts], turn, seeds, should_stop)
        by_key = {(prompts[s.prompt_index][0], s.sample_index): s for s in out}
        for t in first:
            _take(t, by_key[t.key], spec)
    groups: dict[int, list[Trajectory]] = {}
    for t in later:
        left = min(sampling.max_new_tokens, spec.max_response_length - len(t.tokens))
        groups.setdefault(left, []).append(t)
    for left, group in sorted(groups.items()):
        turn = replace(sampling, n=1, max_new_tokens=left)
        seeds = None if group[0].seed is None else [
            continuation_seed(t.seed, t.sample_index, len(t.tokens)) for t in group
        ]  # fmt: skip
        out = engine.generate([t.prompt + t.tokens for t in group], turn, seeds, should_stop)
        for t, s in zip(group, out, strict=True):
            _take(t, s, spec)


def _take(t: Trajectory, s: Sample, spec: AgentSpec) -> None:
    """Append a turn's sampled ids and log-probs as the engine returned them."""
    t.tokens += s.token_ids
    t.logprobs += s.logprobs
    t.turns += 1
    if s.token_ids and s.token_ids[-1] == spec.call_end_id:
        t.last_ended_by = "call"
    else:
        t.last_ended_by = "length" if s.finish_reason == "length" else "eos"
    t.finish_reason = s.finish_reason  # provisional: the step may go on


def _wants_step(t: Trajectory, spec: AgentSpec) -> bool:
    """Whether the environment answers this turn, else the trajectory ends here."""
    if len(t.tokens) >= spec.max_response_length:
        t.finish_reason = "budget" if t.last_ended_by == "call" else t.finish_reason
        return False
    if t.last_ended_by == "call" and t.turns >= spec.max_turns:
        t.finish_reason = "max_turns"
        return False
    return True


def _steps(stepping, pool, tokenizer, spec, should_stop) -> dict:
    requests = {}
    for t in stepping:
        start = t.env_spans[-1][1] if t.env_spans else 0
        text = tokenizer.decode(t.tokens[start:], skip_special_tokens=False)
        call, error = (None, None)
        if t.last_ended_by == "call":
            call, error = spec.format.parse(text)
        requests[t.key] = ("step", t.state, Action(text, t.last_ended_by, call, error))
    return _await(pool, requests, should_stop)


def _await(pool, requests: dict, should_stop) -> dict:
    """Submit every request and wait for all outcomes, asking the stop request between polls."""
    for key, request in requests.items():
        pool.submit(key, request)
    outcomes: dict = {}
    while len(outcomes) < len(requests):
        if should_stop is not None and should_stop():
            pool.cancel_all()
            raise StepAborted("rollout/tools")
        outcomes.update(pool.poll(POLL_S))
    return outcomes


def _answer_text(observation: str, spec: AgentSpec) -> str:
    cut = truncate(observation, spec.max_tool_response_length, spec.truncate_side)
    return spec.format.answer(cut)


def _apply(t: Trajectory, result: StepResult, tokenizer, spec: AgentSpec, stats) -> None:
    """The environment's answer to the turn: its reward on the turn's last token, then the
    answer appended (encoded once, alone) or the trajectory ended."""
    if t.last_ended_by == "call":
        stats.tool_status[result.info.get("status", "ok")] += 1
    if result.reward:
        t.step_rewards.append((len(t.tokens) - 1, float(result.reward)))
    t.state = result.state
    if result.done:
        return  # finish_reason stays the turn's own ("stop" or "length")
    if isinstance(result.observation, str):
        block = tokenizer.encode(_answer_text(result.observation, spec), add_special_tokens=False)
    else:
        block = list(result.observation)
        bad = [i for i in block if not 0 <= i < len(tokenizer)]
        if bad:
            raise ValueError(
                f"environment observation has token ids {bad[:5]} outside the vocabulary"
            )
    # the block and at least one more policy token must fit
    if len(t.tokens) + len(block) + 1 > spec.max_response_length:
        t.finish_reason = "budget"
        return
    t.env_spans.append((len(t.tokens), len(t.tokens) + len(block)))
    t.tokens += block
    t.logprobs += [0.0] * len(block)
    t.finish_reason = None
