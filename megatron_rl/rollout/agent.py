"""Multi-turn rollouts with tools: the policy generates until a tool call, the environment
answers, the answer's tokens are appended, and the policy goes on.

Token in, token out: a trajectory is the prompt's ids, then each turn's ids as the engine
sampled them, then each answer's block encoded once, alone, and appended as it is. Nothing
is decoded to be encoded again, so the trainer reads exactly the ids the engine saw and
sampled (re-rendering the conversation after each turn can give other ids, which verl and
others found silently biases the loss). Decoding happens only to read: the environment
reads a turn's text to find the call.

Two loops, the same samples for the same seeds (tested):
- `run_in_flight` (vLLM, the trainer's): every trajectory in flight at once; the engine keeps
  generating the others while a tool runs (verl's AgentLoop, AReaL). Requests go to vLLM one
  by one (`VLLMEngine.stream_*`); see its docstring for the dataflow.
- `run_turns`, turn-synchronous (NeMo-RL's `run_multi_turn_rollout`; the `hf` engine, and the
  benchmark's baseline): turn k of every active trajectory in engine calls, then their
  environment steps on the pool (`num_workers` at once), then turn k + 1. Dataflow of one
  turn: continuation prompts (prompt + tokens so far) -> `engine.generate` (grouped by the
  tokens each may still draw) -> per trajectory: the call parsed, a step submitted ->
  `pool.poll` until every step answered (the stop request asked between polls) -> answers
  appended or the trajectory ended.

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
from megatron_rl.rollout.types import (
    ABORT_CHECK_STEPS,
    UNFINISHED,
    Engine,
    EngineWrapper,
    GenerationStopped,
    Sample,
    SamplingConfig,
    check_generate,
    continuation_seed,
)

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
    tool_status: list[str] = field(default_factory=list)
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
            step_rewards=self.step_rewards, tool_status=self.tool_status,
        )  # fmt: skip

    def cut(self, turn: tuple[list[int], list[float]], stepping: bool, sampler_state) -> Sample:
        """This unfinished trajectory as a stop left it (`UNFINISHED`): its tokens with the
        turn being generated so far (`turn`: its ids and log-probs), where its loop stood
        (`Sample.agent_state`) and the turn's random state (`sampler_state`)."""
        ids, logprobs = turn
        return Sample(
            self.prompt_index, self.sample_index, self.prompt, self.tokens + ids,
            self.logprobs + logprobs, UNFINISHED, env_spans=self.env_spans,
            step_rewards=self.step_rewards, tool_status=self.tool_status,
            sampler_state=sampler_state,
            agent_state={"turns": self.turns, "state": self.state, "stepping": stepping,
                         "last_ended_by": self.last_ended_by, "turn_tokens": len(ids)},
        )  # fmt: skip

    @classmethod
    def resumed(cls, s: Sample, task: Task, seed: int | None) -> Trajectory:
        """The trajectory of a response `cut` gave (or a finished one), as it stood."""
        a = s.agent_state or {}
        t = cls(s.prompt_index, s.sample_index, list(s.prompt_token_ids), task, seed,
                list(s.token_ids), list(s.logprobs), list(s.env_spans), list(s.step_rewards),
                list(s.tool_status))  # fmt: skip
        if s.finish_reason != UNFINISHED:
            t.finish_reason = s.finish_reason
            return t
        t.turns, t.state, t.last_ended_by = a["turns"], a["state"], a["last_ended_by"]
        return t


FINISH_REASONS = ("stop", "length", "max_turns", "budget")
TOOL_STATUSES = (
    "ok",
    "error",
    "timeout",
    "output_limit",
    "killed",
    "bad_call",
    "env_error",
    "died",
)
"""How a call went: the sandbox's result, a call that could not be parsed or named another
function (bad_call), or the pool's failures (`envs/pool.py`). Every one is logged, 0 where
none happened, so that ranks' metrics average over the same keys."""


def multi_turn_metrics(samples: list[Sample]) -> dict[str, float]:
    """`rollout/multi_turn/*`, `rollout/finish/*` and `tool/*_rate` of a rollout's samples
    (every known finish reason and tool status, 0 where none happened)."""
    n = max(len(samples), 1)
    env = [sum(b - a for a, b in s.env_spans) for s in samples]
    statuses = Counter(status for s in samples for status in s.tool_status)
    calls = max(sum(statuses.values()), 1)
    out = {
        "rollout/multi_turn/turns/mean": sum(s.num_turns for s in samples) / n,
        "rollout/multi_turn/env_tokens/mean": sum(env) / n,
        "rollout/multi_turn/policy_tokens/mean": sum(
            len(s.token_ids) - e for s, e in zip(samples, env, strict=True)
        )
        / n,
        "rollout/multi_turn/tool_calls/mean": sum(statuses.values()) / n,
    }
    finish = Counter(s.finish_reason for s in samples)
    out.update({f"rollout/finish/{k}": finish[k] / n for k in FINISH_REASONS})
    for k in sorted(set(TOOL_STATUSES) | set(statuses)):
        out[f"tool/{k}_rate"] = statuses[k] / calls
    return out


def run_turns(
    engine,
    prompts: list[list[int]],
    tasks: list[Task],
    sampling: SamplingConfig,
    seeds: list[int] | None,
    spec: AgentSpec,
    steps: EnvSteps | SharedEnvSteps,
    tokenizer,
    should_stop: Callable[[], bool] | None = None,
) -> list[Sample]:
    """`sampling.n` multi-turn samples per prompt, prompt-major as `engine.generate`'s.
    `steps` runs the environment's requests (`EnvSteps` around an
    `EnvPool`); `tokenizer`: the policy's (decodes turns to read calls, encodes answers
    once). `should_stop` goes to the engine and is asked between pool polls; yes cancels
    the pool's steps and raises `StepAborted`."""
    trajectories, sampling = _start(prompts, tasks, sampling, seeds, spec, steps, tokenizer,
                                    should_stop)  # fmt: skip
    active = list(trajectories)
    while active:
        _generate_turn(engine, active, sampling, spec, should_stop)
        stepping = [t for t in active if _wants_step(t, spec)]
        answers = _steps(stepping, steps, tokenizer, spec, should_stop)
        for t in stepping:
            _apply(t, answers[t.key], tokenizer, spec)
        active = [t for t in active if t.finish_reason is None]
    return [t.sample() for t in trajectories]


def run_in_flight(
    engine,
    prompts: list[list[int]],
    tasks: list[Task],
    sampling: SamplingConfig,
    seeds: list[int] | None,
    spec: AgentSpec,
    steps: EnvSteps | SharedEnvSteps,
    tokenizer,
    should_stop: Callable[[], bool] | None = None,
    partial: list[Sample] | None = None,
) -> list[Sample]:
    """`run_turns`' samples, with every trajectory in flight at once: the engine keeps
    generating the others while a tool runs (verl's AgentLoop, AReaL). Needs a streaming
    engine (`VLLMEngine.stream_*`).

    Dataflow of one iteration: the answers ready now are applied and their trajectories'
    next turns submitted (seeded as in `run_turns`, so the same seeds draw the same tokens
    whatever the timing); one engine step; each turn that finished goes to the pool or ends
    its trajectory. With no request running, the iteration waits on the pool (<= POLL_S).
    The stop request is asked every ABORT_CHECK_STEPS iterations, agreed over the engine's
    ranks: yes aborts the requests, cancels the tools and raises `GenerationStopped` with
    every trajectory as far as it got (`Trajectory.cut`). `partial`: those, continued: a
    trajectory the environment was answering asks it again (same state, same action), one
    cut inside a turn goes on with the turn's random state."""
    if partial is None:
        trajectories, sampling = _start(prompts, tasks, sampling, seeds, spec, steps, tokenizer,
                                        should_stop)  # fmt: skip
        first = replace(
            sampling, max_new_tokens=min(sampling.max_new_tokens, spec.max_response_length)
        )
        for i in range(len(prompts)):
            t = trajectories[i * sampling.n]
            engine.stream_submit(("first", i), t.prompt, first, t.seed)
        live = {t.key for t in trajectories}
    else:
        trajectories, sampling = _continue(engine, partial, tasks, sampling, seeds, spec, steps,
                                           tokenizer)  # fmt: skip
        live = {t.key for t in trajectories if t.finish_reason is None}
    by_key = {t.key: t for t in trajectories}
    turn: dict[tuple[int, int], tuple[list[int], list[float]]] = {}
    iteration = 0
    while engine.stream_pending() or steps.outstanding:
        if iteration % ABORT_CHECK_STEPS == 0 and should_stop is not None:
            if engine.any_engine_rank(should_stop()):
                states, stepping = engine.stream_abort(), set(steps.outstanding)
                steps.cancel()
                raise GenerationStopped("rollout/generate", [
                    t.cut(turn.get(t.key, ([], [])), t.key in stepping,
                          states.get((t.key, 0), states.get((("first", t.prompt_index), t.sample_index))))
                    if t.key in live else t.sample()
                    for t in trajectories
                ])  # fmt: skip
        iteration += 1
        for key, outcome in steps.ready(0.0 if engine.stream_pending() else POLL_S):
            t = by_key[key]
            _apply(t, outcome, tokenizer, spec)
            if t.finish_reason is None:
                _submit_next(engine, t, sampling, spec)
            else:
                live.discard(key)
        if not engine.stream_pending():
            continue
        for key, j, tokens, logprobs, finish in engine.stream_step():
            t = by_key[(key[1], j) if key[0] == "first" else key]
            got = turn.setdefault(t.key, ([], []))
            got[0].extend(tokens)
            got[1].extend(logprobs)
            if finish is None:
                continue
            ids, lps = turn.pop(t.key)
            _take(t, Sample(t.prompt_index, t.sample_index, t.prompt, ids, lps, finish), spec)
            if _wants_step(t, spec):
                steps.submit(t.key, _action(t, spec, tokenizer))
            else:
                live.discard(t.key)
    return [t.sample() for t in trajectories]


def _submit_next(
    engine, t: Trajectory, sampling: SamplingConfig, spec: AgentSpec, cut: Sample | None = None
) -> None:
    """The trajectory's next turn; `cut`: the turn a stop cut, its tokens so far (already
    in `t.tokens`) and random state."""
    done = 0 if cut is None else cut.agent_state["turn_tokens"]
    left = min(sampling.max_new_tokens - done, spec.max_response_length - len(t.tokens))
    seed = continuation_seed(t.seed, t.sample_index, len(t.tokens) - done)
    state = None if cut is None else cut.sampler_state
    engine.stream_submit(
        t.key, t.prompt + t.tokens, replace(sampling, n=1, max_new_tokens=left), seed, state
    )


def _continue(engine, partial, tasks, sampling, seeds, spec, steps, tokenizer):
    """The trajectories of `partial` (`Trajectory.cut`'s) as they stood, the unfinished ones
    going on: the environment asked again where it was answering, the turn resubmitted
    where a stop cut it; and the turns' sampling (`_start`'s)."""
    sampling = _turn_sampling(sampling, spec)
    trajectories = [
        Trajectory.resumed(s, tasks[s.prompt_index], None if seeds is None else seeds[s.prompt_index])
        for s in partial
    ]  # fmt: skip
    for t, s in zip(trajectories, partial, strict=True):
        if t.finish_reason is not None:
            continue
        if s.agent_state["stepping"]:
            steps.submit(t.key, _action(t, spec, tokenizer))
        else:
            _submit_next(engine, t, sampling, spec, cut=s)
    return trajectories, sampling


def _turn_sampling(sampling: SamplingConfig, spec: AgentSpec) -> SamplingConfig:
    """A turn's sampling: it also stops at the format's call end."""
    return replace(sampling, stop_token_ids=(*sampling.stop_token_ids, spec.call_end_id))


def _start(prompts, tasks, sampling, seeds, spec, steps, tokenizer, should_stop):
    """The trajectories of a rollout, each prompt's environment reset, and the sampling
    that stops at the format's call end."""
    trajectories = [
        Trajectory(i, j, list(p), tasks[i], None if seeds is None else seeds[i])
        for i, p in enumerate(prompts)
        for j in range(sampling.n)
    ]
    _reset(trajectories, steps, tokenizer, spec, should_stop)
    return trajectories, _turn_sampling(sampling, spec)


def _reset(trajectories, steps, tokenizer, spec, should_stop) -> None:
    """Each prompt's first state, shared by its samples (one task, one reset); a first
    observation joins the prompt (context, never trained on, as the prompt is)."""
    tasks = {t.prompt_index: t.task for t in trajectories}
    outcomes = steps.run({i: ("reset", task) for i, task in tasks.items()}, should_stop)
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
    stop = {} if should_stop is None else {"should_stop": should_stop}  # aborting engines
    first = [t for t in active if t.turns == 0]
    later = [t for t in active if t.turns > 0]
    if first:
        prompts = sorted({t.prompt_index: t.prompt for t in first}.items())
        seeds = None if first[0].seed is None else [
            next(t.seed for t in first if t.prompt_index == i) for i, _ in prompts
        ]  # fmt: skip
        turn = replace(sampling, max_new_tokens=min(sampling.max_new_tokens,
                                                    spec.max_response_length))  # fmt: skip
        out = engine.generate([p for _, p in prompts], turn, seeds, **stop)
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
        out = engine.generate([t.prompt + t.tokens for t in group], turn, seeds, **stop)
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


def _action(t: Trajectory, spec: AgentSpec, tokenizer) -> tuple:
    """The environment's request for the turn `t` just ended: its text decoded (to read),
    the call parsed when it ended in one."""
    start = t.env_spans[-1][1] if t.env_spans else 0
    text = tokenizer.decode(t.tokens[start:], skip_special_tokens=False)
    call, error = spec.format.parse(text) if t.last_ended_by == "call" else (None, None)
    return ("step", t.state, Action(text, t.last_ended_by, call, error))


def _steps(stepping, steps, tokenizer, spec, should_stop) -> dict:
    return steps.run({t.key: _action(t, spec, tokenizer) for t in stepping}, should_stop)


class EnvSteps:
    """Environment requests on a pool: `submit` and `ready` for loops that go on while tools
    run, `run` to wait for a batch of them (asking the stop request between polls: yes
    cancels the pool's steps, `StepAborted("rollout/tools")`)."""

    def __init__(self, pool):
        self.pool = pool
        self.outstanding: set = set()

    def submit(self, key, request: tuple) -> None:
        self.outstanding.add(key)
        self.pool.submit(key, request)

    def ready(self, timeout_s: float) -> list[tuple]:
        """(key, outcome) of the requests finished within `timeout_s`."""
        done = self.pool.poll(timeout_s)
        self.outstanding.difference_update(key for key, _ in done)
        return done

    def cancel(self) -> None:
        self.pool.cancel_all()
        self.outstanding.clear()

    def run(self, requests: dict, should_stop: Callable[[], bool] | None) -> dict:
        for key, request in requests.items():
            self.submit(key, request)
        outcomes: dict = {}
        while len(outcomes) < len(requests):
            if should_stop is not None and should_stop():
                self.cancel()
                raise StepAborted("rollout/tools")
            outcomes.update(self.ready(POLL_S))
        return outcomes


class SharedEnvSteps:
    """`EnvSteps` for an engine of several ranks (vLLM TP > 1): its ranks step in lockstep
    and must append the same answers, so only the engine's first rank (`src`, global rank)
    runs the pool and broadcasts the outcomes over the engine's gloo `group`; the other
    ranks submit nothing and count what is outstanding alike. In `run`, a stop is that
    rank's to see while tools run (a job's stop signal reaches every rank) and goes to the
    others in the same broadcast; the engine agrees on stops while it generates."""

    def __init__(self, local: EnvSteps | None, group, src: int):
        self.local, self.group, self.src = local, group, src
        self.outstanding: set = set()

    def _broadcast(self, value):
        # why: torch.distributed only where an engine spans ranks
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]

    def submit(self, key, request: tuple) -> None:
        self.outstanding.add(key)
        if self.local is not None:
            self.local.submit(key, request)

    def ready(self, timeout_s: float) -> list[tuple]:
        done = self._broadcast(None if self.local is None else self.local.ready(timeout_s))
        self.outstanding.difference_update(key for key, _ in done)
        return done

    def cancel(self) -> None:
        if self.local is not None:
            self.local.cancel()
        self.outstanding.clear()

    def run(self, requests: dict, should_stop: Callable[[], bool] | None) -> dict:
        result = None
        if self.local is not None:
            try:
                result = self.local.run(requests, should_stop)
            except StepAborted as e:
                result = e
        result = self._broadcast(result)
        if isinstance(result, StepAborted):
            raise result
        return result


def _answer_text(observation: str, spec: AgentSpec) -> str:
    cut = truncate(observation, spec.max_tool_response_length, spec.truncate_side)
    return spec.format.answer(cut)


def _apply(t: Trajectory, result: StepResult, tokenizer, spec: AgentSpec) -> None:
    """The environment's answer to the turn: its reward on the turn's last token, then the
    answer appended (encoded once, alone) or the trajectory ended."""
    if t.last_ended_by == "call":
        t.tool_status.append(str(result.info.get("status", "ok")))
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


class AgentEngine(EngineWrapper):
    """A rollout engine whose `generate` runs multi-turn rollouts (`run_in_flight` on a
    streaming engine, vLLM; `run_turns` on others) on the engine it wraps; the rest of the
    `Engine` (sleep, wake_up, update_weights, ...) is that engine's. `generate(...,
    tasks=)` takes each prompt's `Task` (what the environment's reset reads); without them
    (an evaluation) the tasks are empty."""

    multi_turn = True
    partial_rollouts = False
    """A turn's continuation is its own request: the weights may change between turns, never
    inside one, so there is nothing for a refresh to interrupt."""

    @property
    def continues_partial(self) -> bool:
        """In flight only (a streaming engine, `run_in_flight`): turn by turn, a stop waits
        for the turn's end or cancels the tools, and the chunk is generated again."""
        return self.inner.streams

    def __init__(
        self, engine: Engine, spec: AgentSpec, steps: EnvSteps | SharedEnvSteps, tokenizer
    ):
        super().__init__(engine)
        self.spec, self.steps, self.tokenizer = spec, steps, tokenizer

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingConfig,
        seeds: list[int] | None = None,
        should_stop: Callable[[], bool] | None = None,
        tasks: list[Task] | None = None,
        refresh: None = None,
        partial: list[Sample] | None = None,
    ) -> list[Sample]:
        """`partial`: the trajectories a stopped call left (`GenerationStopped.samples`),
        continued (`run_in_flight`)."""
        check_generate(self, prompts, seeds, should_stop, tasks, refresh, partial, sampling.n)
        tasks = tasks if tasks is not None else [Task(None)] * len(prompts)
        args = (self.inner, prompts, tasks, sampling, seeds, self.spec, self.steps,
                self.tokenizer, should_stop)  # fmt: skip
        # in flight where the engine streams (vLLM); else turn by turn (`hf`): same samples
        return run_in_flight(*args, partial=partial) if self.inner.streams else run_turns(*args)
