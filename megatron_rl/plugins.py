"""User code by import path (`package.module:attribute`): reward functions, rollout
strategies, environments. A leaf module (the standard library only), so a worker process
that builds a plugin does not import torch to find it."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def load_callable(path: str, what: str = "reward function") -> Callable:
    """`package.module:function` -> the function, with errors that name the path."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} {path!r}: expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{what} {path!r}: cannot import module {module_name!r}: {e}") from e
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} {path!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{what} {path!r}: {attr!r} is not callable")
    return obj
