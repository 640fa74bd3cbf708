"""Unit tier: the `Engine` protocol (`rollout/types.py`) is implemented explicitly by every
engine and wrapper (no attribute forwarded by `__getattr__`, no capability probed with a
default), and `check_generate`, the preconditions every `generate` shares, refuses by name."""

from __future__ import annotations

import typing

import pytest

from megatron_rl.rollout.agent import AgentEngine
from megatron_rl.rollout.hf_engine import HFEngine
from megatron_rl.rollout.replica import ReplicaEngine
from megatron_rl.rollout.types import (
    UNFINISHED,
    Engine,
    EngineAsleep,
    EngineWrapper,
    Sample,
    StreamingEngine,
    check_generate,
    require_awake,
)
from megatron_rl.rollout.vllm_engine import VLLMEngine

ENGINES = [VLLMEngine, HFEngine, ReplicaEngine, AgentEngine]


def members(protocol) -> set[str]:
    """The attributes and methods a protocol declares (its own and its bases')."""
    names = set()
    for cls in protocol.__mro__:
        if cls in (object, typing.Protocol, typing.Generic):
            continue
        names |= set(getattr(cls, "__annotations__", {}))
        names |= {n for n in vars(cls) if not n.startswith("_")}
    return names


@pytest.mark.parametrize("cls", ENGINES, ids=lambda c: c.__name__)
def test_every_engine_and_wrapper_declares_every_member_of_the_protocol(cls):
    assert "__getattr__" not in {n for c in cls.__mro__ for n in vars(c)}
    # flags are class attributes or properties; `awake` is set per instance by the engines
    declared = {n for c in cls.__mro__ for n in vars(c)}
    missing = members(Engine) - declared - {"awake"}
    assert missing == set()
    if cls in (VLLMEngine, HFEngine):  # `awake` is the engine's own state
        assert "awake" in cls.__init__.__code__.co_names
    else:
        assert "awake" in declared


def test_a_streaming_engine_is_one_that_says_so():
    assert VLLMEngine.streams and members(StreamingEngine) - members(Engine) <= set(
        vars(VLLMEngine)
    )
    assert not HFEngine.streams and not EngineWrapper.streams


class _Engine:
    """The flags `check_generate` reads, and an `awake` set."""

    def __init__(self, aborts=False, multi_turn=False, partial=False):
        self.aborts_generation, self.multi_turn, self.partial_rollouts = aborts, multi_turn, partial
        self.continues_partial = partial
        self.awake = {"weights"}


def _responses(prompts, n, **changes) -> list[Sample]:
    """Every (prompt, sample) pair's response so far, prompt-major."""
    return [
        Sample(i, j, list(p), [7], [-0.1], UNFINISHED, **changes)
        for i, p in enumerate(prompts)
        for j in range(n)
    ]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"should_stop": lambda: False}, r"_Engine.generate does not take should_stop \(_Engine.aborts_generation is False\)"),
        ({"tasks": [None, None]}, r"does not take tasks \(_Engine.multi_turn is False\)"),
        ({"refresh": object()}, r"does not take refresh \(_Engine.partial_rollouts is False\)"),
        ({"partial": _responses([[1], [2]], 2), "n": 2}, r"does not take partial \(_Engine.continues_partial is False\)"),
    ],
)  # fmt: skip
def test_an_argument_the_engine_cannot_honour_is_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        check_generate(_Engine(), [[1], [2]], None, **kwargs)
    able = _Engine(aborts=True, multi_turn=True, partial=True)
    check_generate(able, [[1], [2]], [5, 6], **kwargs)


def test_partial_responses_are_every_pair_of_the_call_with_its_prompt():
    able, prompts = _Engine(partial=True), [[1], [2]]
    with pytest.raises(ValueError, match=r"not the 4 \(prompt, sample\) pairs of 2 prompts x 2"):
        check_generate(able, prompts, None, partial=_responses(prompts, 2)[:3], n=2)
    swapped = _responses(prompts, 2)
    swapped[0], swapped[2] = swapped[2], swapped[0]
    with pytest.raises(ValueError, match="not the 4"):
        check_generate(able, prompts, None, partial=swapped, n=2)
    other = _responses([[1], [3]], 2)
    with pytest.raises(ValueError, match=r"\(1, 0\) belongs to another prompt"):
        check_generate(able, prompts, None, partial=other, n=2)


def test_seeds_and_tasks_are_one_per_prompt_and_no_prompt_is_empty():
    engine = _Engine(multi_turn=True)
    with pytest.raises(ValueError, match="1 seeds for 2 prompts"):
        check_generate(engine, [[1], [2]], [5])
    with pytest.raises(ValueError, match="3 tasks for 2 prompts"):
        check_generate(engine, [[1], [2]], None, tasks=[None] * 3)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        check_generate(engine, [[1], []], None)


def test_an_asleep_part_is_named():
    with pytest.raises(EngineAsleep, match=r"the _Engine cannot generate: its \['kv_cache'\]"):
        require_awake(_Engine(), "weights", "kv_cache", use="generate")
    require_awake(_Engine(), "weights", use="take weights")
