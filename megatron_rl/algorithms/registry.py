"""Named registries (advantage estimators, policy losses), as verl's `core_algos` keeps them:
a new entry is one function and one decorator; an unknown name is refused with a hint.

An entry may carry traits, registered with it (`@register_adv_est("gae", needs_critic=True)`),
so that callers ask the registry what an entry needs instead of testing its name."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable)


@dataclass(frozen=True)
class EstimatorTraits:
    """What an advantage estimator needs from the run; read by config validation and the
    trainer in place of tests of the estimator's name."""

    needs_critic: bool = False
    """It reads [B, T] critic values (GAE): the run has a critic unless critic.enable says no."""
    needs_groups: bool = False
    """It compares the samples of one prompt (GRPO, RLOO, REINFORCE++ baseline): it needs
    n_samples_per_prompt >= 2 and whole groups (no rating strategy that drops samples)."""
    needs_teacher: bool = False
    """It takes its whole signal from a teacher (on-policy distillation alone): the run
    needs `teacher.path` and has no use for a critic."""


def registrar(
    registry: dict[str, Callable],
    what: str,
    traits: dict[str, Any] | None = None,
    traits_type: Callable[..., Any] | None = None,
) -> Callable[..., Callable[[F], F]]:
    """`register = registrar(REGISTRY, "policy loss")`, then `@register("name")`. With a
    `traits` dict and its `traits_type`, `@register("name", flag=True)` also stores
    `traits_type(flag=True)` under the name (unflagged entries get the defaults)."""

    def register(name: str, **flags: Any) -> Callable[[F], F]:
        if flags and traits is None:
            raise TypeError(f"{what} registry takes no traits, got {sorted(flags)}")
        entry_traits = traits_type(**flags) if traits is not None else None  # bad flags: now

        def add(fn: F) -> F:
            if name in registry:
                raise ValueError(f"{what} {name!r} is already registered")
            registry[name] = fn
            if traits is not None:
                traits[name] = entry_traits
            return fn

        return add

    return register


def lookup(registry: dict[str, Any], name: str, what: str) -> Any:
    if name not in registry:
        close = difflib.get_close_matches(name, registry, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown {what} {name!r}{hint}; registered: {sorted(registry)}")
    return registry[name]
