"""Unit tier: `RoleModel`, the model keywords the three roles share, and the reference's
refusal of a recompute setting it would never use (checked before any model is built)."""

import dataclasses

import pytest

from megatron_rl.models.gpt import RecomputeConfig
from megatron_rl.models.presets import preset_arch
from megatron_rl.parallel.distributed import ParallelLayout
from megatron_rl.workers.policy import ReferencePolicy
from megatron_rl.workers.spec import RoleModel


def test_role_model_is_frozen():
    model = RoleModel(preset_arch("tiny"), ParallelLayout())
    with pytest.raises(dataclasses.FrozenInstanceError):
        model.model_path = "elsewhere"


@pytest.mark.parametrize(
    "recompute",
    [RecomputeConfig("full"), RecomputeConfig("selective"), RecomputeConfig(num_layers=2)],
)
def test_reference_refuses_a_recompute_setting_by_name(recompute):
    model = RoleModel(preset_arch("tiny"), ParallelLayout(), recompute=recompute)
    with pytest.raises(ValueError, match=r"RoleModel\.recompute=.*forward only"):
        ReferencePolicy(model)
