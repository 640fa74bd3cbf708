"""A typed dataclass from nested dicts / YAML with `key=value` overrides, and back.

    data = read_yaml("examples/tiny/vapo.yaml")
    apply_override(data, "actor.optim.lr=1e-5")   # the value is parsed as YAML
    config = from_dict(TrainConfig, data)         # every key checked against the dataclasses
    to_dict(config)                               # plain data again (saved with checkpoints)

It knows no section by name: a field is built from its type annotation (dataclasses, optional
and Literal types, `tuple[X, ...]`, dicts, bool/int/float/str, `torch.dtype` by name), or,
where one annotated type cannot say which class a value is (a list whose items choose their
class by a tag, as `rewards.reward_fns` entries do by `type`), by the parser its field names
in `items_parsed_by` metadata. An unknown key is refused with the closest known one; a value
of the wrong type names its key and the expected type; a section's `__post_init__` error is
prefixed with the section.

Where it sits: it imports nothing from megatron_rl, so it is below every module of the
package; but importing it runs `megatron_rl/config/__init__.py`, which imports the run's
sections (models, rewards, rollout, workers). A module those sections import cannot use it
without a cycle; for them it would move unchanged to the top level (`megatron_rl/loader.py`).
The entry points, tools and plugins can use it today for their own dataclasses.

Why not OmegaConf (2.4.0; 2.3 pins an antlr4 that math-verify's conflicts with): tried
against these dataclasses, `OmegaConf.structured(TrainConfig)` refuses the `torch.dtype`
annotation of `model.precision.params_dtype`; a `tuple[RewardFnConfig, ...]` field takes
its items as untyped dicts (no class chosen by `type`, no unknown-key check), and
`tuple[EvalSetConfig, ...]` items stay dicts after `to_object`, so `trainer.eval_sets`
never builds; `__post_init__` checks run only in `to_object`, away from the key that caused
them; and its messages differ from the ones the tests and users rely on ("Value 'many' of
type 'str' could not be converted to Integer" for "trainer.total_steps: expected int, got
'many'"). Keeping it would mean this module's code around it anyway.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml


class ConfigError(ValueError):
    pass


ItemParser = Callable[[Any, str], Any]
"""(value, key) -> the built item; raises ValueError with a message that names `key`."""


def items_parsed_by(parse: ItemParser, *, what: str, tag: str | None = None) -> dict:
    """Field metadata for a `tuple[Base, ...]` field whose items `parse` builds, each choosing
    its own class (a tagged union). `what` names the items in errors ("reward functions");
    `tag` is the ClassVar each item's class carries and `to_dict` writes back first (`type`).

        reward_fns: tuple[RewardFnConfig, ...] = field(
            default=(), metadata=items_parsed_by(reward_fn_config, what="reward functions",
                                                 tag="type"))
    """
    return {"items_parsed_by": parse, "what": what, "tag": tag}


def _unwrap_optional(tp):
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _coerce(value: Any, tp, key: str):
    tp, optional = _unwrap_optional(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"config key {key}: null is not allowed here")
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key)
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"config key {key}: {value!r} is not one of {typing.get_args(tp)}")
        return value
    if origin is tuple or tp is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key {key}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]: each element an X
            return tuple(_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
        return tuple(value)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key {key}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is torch.dtype:
        dtype = getattr(torch, str(value), None)
        if not isinstance(dtype, torch.dtype):
            raise ConfigError(
                f"config key {key}: expected a torch dtype name (float32, bfloat16), got {value!r}"
            )
        return dtype
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key {key}: expected true or false, got {value!r}")
    if tp in (int, float):
        try:
            number = tp(value) if not isinstance(value, bool) else None
        except (TypeError, ValueError):
            number = None
        if number is None or (tp is int and isinstance(value, float) and value != int(value)):
            raise ConfigError(f"config key {key}: expected {tp.__name__}, got {value!r}")
        return number
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"config key {key}: expected a string, got {value!r}")
        return str(value)
    return value


def _parse_items(value: Any, meta: dict, key: str) -> tuple:
    """A field with `items_parsed_by` metadata: a list, each item built by its parser."""
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"config key {key}: expected a list of {meta['what']}")
    try:
        return tuple(meta["items_parsed_by"](v, f"{key}[{i}]") for i, v in enumerate(value))
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None


def yaml_key(f: dataclasses.Field) -> str:
    """A field's key in YAML: its name, or its metadata's "key" where the name cannot be
    one (`async` is a Python keyword: field `async_`, key `async`)."""
    return f.metadata.get("key", f.name)


def from_dict(cls, data: Any, prefix: str = ""):
    """Build dataclass `cls` from nested dicts; unknown keys are errors with a suggestion."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ConfigError(f"config key {prefix or '<root>'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {yaml_key(f): f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        if name not in fields:
            close = difflib.get_close_matches(name, fields, n=1)
            hint = (
                f" (did you mean {(prefix + '.' if prefix else '') + close[0]!r}?)" if close else ""
            )
            raise ConfigError(f"unknown config key {key!r}{hint}; known here: {sorted(fields)}")
        attr, meta = fields[name].name, fields[name].metadata
        if "items_parsed_by" in meta:
            kwargs[attr] = _parse_items(value, meta, key)
        else:
            kwargs[attr] = _coerce(value, hints[attr], key)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config section {prefix or '<root>'}: {e}") from e


def to_dict(config) -> dict:
    """The resolved configuration as plain data (saved next to checkpoints and metrics);
    `from_dict` reads it back to an equal config."""
    if dataclasses.is_dataclass(config):
        out = {}
        for f in dataclasses.fields(config):
            value = to_dict(getattr(config, f.name))
            tag = f.metadata.get("tag")
            if tag:  # a tagged union's items: the class's tag first, as written in YAML
                value = [
                    {tag: getattr(type(item), tag), **plain}
                    for item, plain in zip(getattr(config, f.name), value, strict=True)
                ]
            out[yaml_key(f)] = value
        return out
    if isinstance(config, torch.dtype):
        return str(config).removeprefix("torch.")
    if isinstance(config, (list, tuple)):
        return [to_dict(v) for v in config]
    if isinstance(config, dict):
        return {k: to_dict(v) for k, v in config.items()}
    return config


def apply_override(data: dict, assignment: str) -> None:
    """`a.b.c=value` (value parsed as YAML) into nested dict `data`, in place."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {assignment!r}: expected key=value")
    value = yaml.safe_load(raw) if raw else ""
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {assignment!r}: {part!r} is not a section")
    node[parts[-1]] = value


def read_yaml(path: str | Path) -> dict:
    """A config file's top-level mapping; a missing or malformed file is a ConfigError."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError as e:
        raise ConfigError(f"config file {path}: not found") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path}: not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping at the top level")
    return data


def load(cls, path: str | Path | None, overrides: list[str] = ()):
    """Dataclass `cls` from the YAML file at `path` (None: defaults) and `key=value`
    overrides; an error names the file."""
    data = read_yaml(path) if path is not None else {}
    for assignment in overrides:
        apply_override(data, assignment)
    try:
        return from_dict(cls, data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}" if path is not None else str(e)) from None
