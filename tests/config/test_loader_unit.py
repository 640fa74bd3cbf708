"""The generic loader: YAML + key=value overrides into typed dataclasses, and back; every
bad key or value named."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import pytest
import yaml

from megatron_rl.config import (
    ConfigError,
    TrainConfig,
    from_dict,
    items_parsed_by,
    load,
    load_config,
    to_dict,
)
from megatron_rl.rewards import MathRewardConfig, PythonRewardConfig

RECIPES = sorted(Path("examples/tiny").glob("*.yaml")) + [
    Path("examples/qwen2.5-32b/vapo.yaml"),
    Path("examples/qwen2.5-32b/vapo_lora.yaml"),
    Path("examples/qwen2.5-7b/distill_from_32b.yaml"),
    Path("examples/qwen3-30b-a3b/grpo.yaml"),
]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p))
def test_every_recipe_loads_and_round_trips(recipe):
    config = load_config(recipe)
    assert from_dict(TrainConfig, yaml.safe_load(yaml.safe_dump(to_dict(config)))) == config


def test_overrides_are_typed_and_nested(tmp_path):
    config = load_config(
        "examples/tiny/vapo.yaml",
        [
            "trainer.total_steps=3",
            "actor.optim.lr=1e-5",  # YAML 1.1 reads this as a string; the field makes it a float
            "model.precision.params_dtype=bfloat16",
            'rewards.reward_fns=[{type: python, path: "tests.reward_fns:constant"}]',
            "rollout.rating.strategy=dynamic_filtering",
        ],
    )
    assert config.trainer.total_steps == 3 and config.actor.optim.lr == 1e-5
    assert str(config.model.precision.params_dtype) == "torch.bfloat16"
    assert config.rewards.reward_fns == (PythonRewardConfig(path="tests.reward_fns:constant"),)
    assert config.rollout.rating.strategy == "dynamic_filtering"
    assert load_config("examples/tiny/vapo.yaml").rewards.reward_fns[0] == MathRewardConfig(
        backend="fast"
    )


@pytest.mark.parametrize(
    "override,message",
    [
        (
            "actor.optim.lrr=1",
            r"unknown config key 'actor.optim.lrr' \(did you mean 'actor.optim.lr'\?\)",
        ),
        ("trainr.total_steps=1", r"unknown config key 'trainr' \(did you mean 'trainer'\?\)"),
        ("trainer.total_steps=many", r"trainer.total_steps: expected int, got 'many'"),
        ("parallel.tensor_model_parallel_size=1.5", r"tensor_model_parallel_size: expected int"),
        ("critic.enable=maybe", r"critic.enable: expected true or false"),
        ("actor.loss.loss_agg_mode=sum", r"actor.loss.loss_agg_mode: 'sum' is not one of"),
        ("rewards.reward_fns=[{type: rm}]", r"rewards.reward_fns\[0\]: unknown type 'rm'"),
        ("model.precision.params_dtype=float33", r"expected a torch dtype name"),
        (
            "model.recompute.granularity=partial",
            r"model.recompute: recompute granularity='partial'",
        ),
        ("actor", r"override 'actor': expected key=value"),
        ("trainer.logger=[console, tensorbord]", r"logger: \['tensorbord'\] unknown; choose from"),
        ("trainer.tensorboard=true", r"unknown config key 'trainer.tensorboard'"),
        ("rollout.temperature=0", r"config section rollout: temperature must be > 0 for RL"),
        ("rollout.top_k=-2", r"rollout: top_k must be 0 or -1 \(off\) or >= 1, got -2"),
        ("rollout.dtype=fp8", r"rollout: dtype must be one of float32, bfloat16, float16"),
        (
            "algorithm.rollout_correction.rollout_is=seq",
            r"algorithm.rollout_correction.rollout_is: 'seq' is not one of",
        ),
        (
            "algorithm.rollout_correction.rollout_rs=geometric",
            r"rollout_rs=geometric needs rollout_rs_threshold > 1, got None",
        ),
    ],
)
def test_bad_keys_and_values_are_named(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("examples/tiny/vapo.yaml", [override])


@dataclass(frozen=True)
class _Shape:
    size: int = 1
    kind: ClassVar[str] = ""


@dataclass(frozen=True)
class _Square(_Shape):
    kind: ClassVar[str] = "square"


@dataclass(frozen=True)
class _Circle(_Shape):
    radius: float = 1.0
    kind: ClassVar[str] = "circle"


def _shape(entry, where):
    entry = dict(entry)
    classes = {"square": _Square, "circle": _Circle}
    if entry.get("kind") not in classes:
        raise ValueError(f"{where}: unknown kind {entry.get('kind')!r}")
    return classes[entry.pop("kind")](**entry)


@dataclass(frozen=True)
class _Drawing:
    title: str = ""
    shapes: tuple[_Shape, ...] = field(
        default=(), metadata=items_parsed_by(_shape, what="shapes", tag="kind")
    )


def test_the_loader_knows_no_section_a_field_names_its_item_parser(tmp_path):
    """A tagged union (each item's class chosen by its tag) is field metadata, not a case in
    the loader: any dataclass can have one, and to_dict writes the tag back first."""
    path = tmp_path / "drawing.yaml"
    path.write_text("title: t\nshapes: [{kind: circle, radius: 2}]\n")
    drawing = load(_Drawing, path, ["shapes=[{kind: square, size: 3}, {kind: circle}]"])
    assert drawing.shapes == (_Square(size=3), _Circle())
    assert to_dict(drawing)["shapes"] == [
        {"kind": "square", "size": 3},
        {"kind": "circle", "size": 1, "radius": 1.0},
    ]
    assert from_dict(_Drawing, to_dict(drawing)) == drawing
    with pytest.raises(ConfigError, match=r"shapes\[0\]: unknown kind 'hexagon'"):
        load(_Drawing, path, ["shapes=[{kind: hexagon}]"])
    with pytest.raises(ConfigError, match="config key shapes: expected a list of shapes"):
        load(_Drawing, path, ["shapes=3"])
    with pytest.raises(ConfigError, match=r"config file .*missing.yaml: not found"):
        load(_Drawing, tmp_path / "missing.yaml")


def test_the_loader_imports_nothing_from_the_package():
    """It sits below every module: any of them may use it for its own config."""
    tree = ast.parse(Path("megatron_rl/config/loader.py").read_text())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in imported if m.startswith("megatron_rl")], imported
