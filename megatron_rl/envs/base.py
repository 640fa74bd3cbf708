"""The environment interface of multi-turn rollouts: what an environment is given and returns.

An environment answers one policy turn at a time: the turn's text and the tool call parsed
from it go in; an observation (text for the chat template's tool role, or token ids), a
reward, and whether the trajectory is done come out.

State is explicit: `reset` returns the trajectory's first state and `step` takes it and
returns the next, picklable both. So any worker of the pool can run any trajectory's step,
and a worker killed for outliving its time limit loses nothing but that one step (the
trajectory keeps the state from before it); an object holding its trajectory's state (the
OpenRLHF / verl shape) would pin every trajectory to one worker and lose them all with it.
One environment object serves every trajectory of its worker, built once from its config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

EndedBy = Literal["call", "eos", "length"]
"""How a policy turn ended: at a tool call's end marker, at EOS (or another stop), or at
its token limit."""


@dataclass(frozen=True)
class Task:
    """What a trajectory is about: its prompt record's fields."""

    prompt: Any
    """The dataset's prompt (text or chat messages)."""
    label: Any = None
    """The reference answer, when the dataset has one."""
    metadata: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ToolCall:
    """A call parsed from a policy turn by the tool format (`rollout/tool_formats.py`)."""

    name: str
    """The function called ("code_interpreter" for the built-in tool)."""
    arguments: dict
    """Its arguments as parsed ({"code": ...} for the interpreter)."""


@dataclass(frozen=True)
class Action:
    """One policy turn, as the environment sees it."""

    text: str
    """The turn's tokens decoded (for reading only: the trajectory keeps the ids)."""
    ended_by: EndedBy
    call: ToolCall | None = None
    """The call the turn ended with, parsed; None when it ended without one or the call
    could not be parsed (then `parse_error` says why)."""
    parse_error: str | None = None
    """Why a call marker was found but no call could be parsed (the format's message)."""


@dataclass(frozen=True)
class EnvReset:
    state: Any = None
    """The trajectory's first state (picklable)."""
    observation: str | None = None
    """Text appended after the prompt before the first turn; None: nothing."""


@dataclass(frozen=True)
class StepResult:
    """An environment's answer to one policy turn."""

    observation: str | list[int] | None
    """Text for the format's tool block, token ids appended as they are, or None (nothing
    appended: the trajectory must then be done)."""
    reward: float = 0.0
    """This step's reward, credited to the last token of the turn that caused it."""
    done: bool = False
    state: Any = None
    """The trajectory's next state (picklable)."""
    info: dict = field(default_factory=dict)
    """What the metrics read: `status` ("ok", "error", "timeout", ...), `seconds`, ..."""

    def __post_init__(self) -> None:
        if self.observation is None and not self.done:
            raise ValueError("a step that is not done must return an observation")


class Environment(Protocol):
    """Built once per worker from `EnvConfig` (type's class, or `python` path with kwargs)."""

    def reset(self, task: Task) -> EnvReset: ...

    def step(self, state: Any, action: Action) -> StepResult: ...
