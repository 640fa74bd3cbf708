"""`EnvConfig`: which environment answers a multi-turn rollout's turns, and its limits.

    env: {type: code_interpreter, num_workers: 4, step_timeout_s: 30,
          sandbox: {timeout_s: 5, memory_limit_mb: 1024}}
    env: {type: python, path: "my_pkg.envs:Maze", kwargs: {size: 8}, num_workers: 2}

`type` is a built-in (`ENV_TYPES`) or `python`, a class by import path built with `kwargs`
(the rule of `reward_fns`' `python` entries). The class is built in each worker of the pool,
never in the rank, so an import error surfaces when the pool starts, before any model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_rl.envs.sandbox import SandboxConfig
from megatron_rl.plugins import load_callable

ENV_TYPES: dict[str, str] = {
    "code_interpreter": "megatron_rl.envs.code_interpreter:CodeInterpreter",
}
"""Built-in environments: name -> class (verl's name for its sandbox tool)."""
ON_TIMEOUT = ("observe", "terminate")


@dataclass(frozen=True)
class EnvConfig:
    type: str = "code_interpreter"
    """A built-in (`ENV_TYPES`) or "python" (the class at `path`)."""
    path: str = ""
    """type python: "package.module:Class", built as Class(**kwargs)."""
    kwargs: dict = field(default_factory=dict)
    """type python: the class's keyword arguments."""
    num_workers: int = 4
    """Worker processes: environment steps that run at once (verl's sandbox `num_workers`)."""
    step_timeout_s: float = 30.0
    """A step not answered by then gets its worker killed (a sandbox it started dies too);
    the trajectory is told so or ends (`on_timeout`). The last line behind the tool's own
    limits, so at least the sandbox's `timeout_s` + 5 s for code_interpreter."""
    on_timeout: str = "observe"
    """"observe": the policy reads "environment did not answer within N s" and goes on;
    "terminate": the trajectory ends there."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """type code_interpreter: the limits and isolation of each code call."""

    def __post_init__(self) -> None:
        known = (*ENV_TYPES, "python")
        if self.type not in known:
            raise ValueError(f"type must be one of {list(known)}, got {self.type!r}")
        if self.type == "python" and not self.path:
            raise ValueError("type python needs path ('package.module:Class')")
        if self.type != "python":
            for name, value in (("path", self.path), ("kwargs", self.kwargs)):
                if value:
                    raise ValueError(f"{name} is for type python; type {self.type!r} takes none")
        if self.type != "code_interpreter" and self.sandbox != SandboxConfig():
            raise ValueError(f"sandbox configures type code_interpreter, not {self.type!r}")
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if not (self.step_timeout_s > 0 and math.isfinite(self.step_timeout_s)):
            raise ValueError(f"step_timeout_s must be > 0 and finite, got {self.step_timeout_s}")
        if self.on_timeout not in ON_TIMEOUT:
            raise ValueError(f"on_timeout must be one of {ON_TIMEOUT}, got {self.on_timeout!r}")
        if self.type == "code_interpreter" and self.step_timeout_s < self.sandbox.timeout_s + 5:
            raise ValueError(
                f"step_timeout_s={self.step_timeout_s:g} must be >= sandbox.timeout_s + 5 "
                f"= {self.sandbox.timeout_s + 5:g}: the sandbox's own limit answers first"
            )

    @property
    def display_name(self) -> str:
        return self.path if self.type == "python" else self.type

    def build(self):
        """The environment object (called in a pool worker)."""
        if self.type == "python":
            return load_callable(self.path, "environment")(**self.kwargs)
        return load_callable(ENV_TYPES[self.type], "environment")(self.sandbox)
