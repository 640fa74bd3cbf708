"""`LoRAConfig`: target modules by Megatron and Hugging Face name, the scale, and what it
refuses, each by name. (The adapters themselves: tests/models/test_lora_distributed.py.)"""

import math

import pytest

from megatron_rl.config import ConfigError, load_config, validate_config
from megatron_rl.models.lora import MEGATRON_TARGETS, LoRAConfig


def test_rank_zero_is_off_and_checks_nothing_else():
    assert not LoRAConfig().enabled
    assert not LoRAConfig(dropout=0.1, merge=False).enabled  # off: nothing of it is used
    assert LoRAConfig(rank=8).enabled


@pytest.mark.parametrize(
    ("names", "megatron"),
    [
        (MEGATRON_TARGETS, set(MEGATRON_TARGETS)),
        (("all-linear",), set(MEGATRON_TARGETS)),
        (("q_proj", "k_proj", "v_proj", "o_proj"), {"linear_qkv", "linear_proj"}),
        (("gate_proj", "up_proj", "down_proj"), {"linear_fc1", "linear_fc2"}),
        (("linear_qkv", "q_proj"), {"linear_qkv"}),  # q_proj is inside the named linear_qkv
    ],
)
def test_targets_by_megatron_and_hugging_face_name(names, megatron):
    assert LoRAConfig(rank=8, target_modules=names).megatron_targets() == megatron


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"target_modules": ("q_proj", "v_proj")}, "q_proj without \\['k_proj'\\]"),
        ({"target_modules": ("gate_proj",)}, "gate_proj without \\['up_proj'\\]"),
        ({"target_modules": ("lm_head",)}, "unknown \\['lm_head'\\]"),
        ({"target_modules": ()}, "target_modules is empty"),
        ({"dropout": 0.05}, "lora.dropout=0.05: only 0"),
        ({"lora_A_init_method": "gaussian"}, "lora_A_init_method 'gaussian'"),
        ({"alpha": 0}, "lora.alpha must be > 0"),
    ],
)
def test_refusals_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        LoRAConfig(rank=8, **fields)


def test_scale_and_rank_stabilised_scale():
    assert LoRAConfig(rank=16, alpha=32).scale == 2.0
    assert math.isclose(LoRAConfig(rank=16, alpha=32, use_rslora=True).scale, 8.0)


def test_the_run_config_takes_lora_per_role(tiny_model_dir):
    config = load_config(
        "examples/tiny/vapo.yaml",
        [f"model.path={tiny_model_dir}", "actor.lora.rank=8", "critic.lora.rank=4"],
    )
    assert config.actor.lora == LoRAConfig(rank=8)
    assert config.critic.lora.rank == 4
    with pytest.raises(ConfigError, match="dropout"):
        load_config("examples/tiny/vapo.yaml", ["actor.lora.rank=8", "actor.lora.dropout=0.1"])
    kl = [f"model.path={tiny_model_dir}", "algorithm.kl_coef=0.01", "actor.ref_param_offload=true"]
    validate_config(load_config("examples/tiny/vapo.yaml", kl), 2)
    with pytest.raises(ConfigError, match="ref_param_offload=true with actor.lora"):
        validate_config(load_config("examples/tiny/vapo.yaml", [*kl, "actor.lora.rank=8"]), 2)


def test_a_checkpoint_records_its_adapters_and_resumes_only_into_the_same(tmp_path):
    import json

    from megatron_rl.trainer.checkpoint import check_same_adapters

    lora = LoRAConfig(rank=8, alpha=32, target_modules=("q_proj", "k_proj", "v_proj"))
    assert LoRAConfig.from_dict(json.loads(json.dumps(lora.to_dict()))) == lora
    (tmp_path / "megatron_rl.json").write_text(json.dumps({"lora_config": lora.to_dict()}))
    check_same_adapters(tmp_path, lora)
    for other in (None, LoRAConfig(rank=16, alpha=32), LoRAConfig(rank=8, alpha=16)):
        with pytest.raises(ValueError, match="resume with the same adapters"):
            check_same_adapters(tmp_path, other)
    # a full one (`lora`: a PEFT adapter merged when it was converted, not adapters of its own)
    (tmp_path / "megatron_rl.json").write_text(json.dumps({"role": "actor", "lora": "/a/dir"}))
    check_same_adapters(tmp_path, None)
    with pytest.raises(ValueError, match="saved with lora None"):
        check_same_adapters(tmp_path, lora)
