"""Named registries (advantage estimators, policy losses), as verl's `core_algos` keeps them:
a new entry is one function and one decorator; an unknown name is refused with a hint."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


def registrar(registry: dict[str, Callable], what: str) -> Callable[[str], Callable[[F], F]]:
    """`register = registrar(REGISTRY, "policy loss")`, then `@register("name")`."""

    def register(name: str) -> Callable[[F], F]:
        def add(fn: F) -> F:
            if name in registry:
                raise ValueError(f"{what} {name!r} is already registered")
            registry[name] = fn
            return fn

        return add

    return register


def lookup(registry: dict[str, Callable], name: str, what: str) -> Callable:
    if name not in registry:
        close = difflib.get_close_matches(name, registry, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown {what} {name!r}{hint}; registered: {sorted(registry)}")
    return registry[name]
