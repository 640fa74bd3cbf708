"""The run configuration: YAML + key=value overrides, typed, checked before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_rl.config import (
    ConfigError,
    TrainConfig,
    from_dict,
    load_config,
    to_dict,
    validate_config,
)
from megatron_rl.rewards import MathRewardConfig, PythonRewardConfig

RECIPES = sorted(Path("examples/tiny").glob("*.yaml")) + [Path("examples/qwen2.5-32b/vapo.yaml")]


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


def test_vapo_recipe_uses_the_papers_settings():
    c = load_config("examples/qwen2.5-32b/vapo.yaml")
    assert (c.actor.optim.lr, c.critic.optim.lr) == (1e-6, 2e-6)
    assert (c.algorithm.lambda_critic, c.algorithm.length_adaptive_alpha, c.algorithm.gamma) == (
        1.0,
        0.05,
        1.0,
    )
    assert (c.actor.loss.clip_eps_low, c.actor.loss.clip_eps_high) == (0.2, 0.28)
    assert c.actor.loss.loss_agg_mode == "token-mean" and c.actor.loss.nll_coef == 0.1
    assert (c.rollout.rollout_batch_size, c.rollout.n_samples_per_prompt) == (512, 16)
    assert c.actor.ppo_mini_batch_size == 512 and c.critic.pretrain_steps == 50
    assert not c.use_reference and c.use_critic
    (aime,) = c.trainer.eval_sets  # the paper reports AIME24 avg@32 at T 1.0, top-p 0.7
    assert (aime.name, aime.n, aime.temperature, aime.top_p) == ("aime24", 32, 1.0, 0.7)
    # The paper's 5,000 steps are gradient updates (its Figure 1), not rollout steps.
    samples = c.rollout.rollout_batch_size * c.rollout.n_samples_per_prompt
    updates_per_step = c.actor.ppo_epochs * samples // c.actor.ppo_mini_batch_size
    assert updates_per_step == 16
    assert 5000 <= c.trainer.total_steps * updates_per_step < 5000 + updates_per_step
    # DAPO's warm-up: 20 rollout steps, in the schedule's unit (updates)
    assert c.actor.optim.lr_warmup_steps == 20 * updates_per_step
    assert c.actor.optim.lr_decay_style == "constant"
    # Nothing the sbatch script does not start: the reward workers' Ray is started locally.
    assert c.rewards.pool.ray_address is None


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


SETS = "trainer.eval_data_path=null"


def test_eval_sets_resolve_names_and_pass_k_and_the_shorthand_is_one_greedy_set():
    shorthand = load_config("examples/tiny/vapo.yaml").trainer
    (greedy,) = shorthand.eval_sets
    assert (greedy.name, greedy.n, greedy.temperature, greedy.pass_k) == (
        "arithmetic_test", 1, 0.0, (1,)
    )  # fmt: skip
    assert shorthand.eval_data_path is None  # resolved: said once, as a set
    sets = load_config(
        "examples/tiny/vapo.yaml",
        [
            SETS,
            "trainer.eval_sets=[{path: d/aime.jsonl, n: 32, temperature: 1.0}, {path: d/m.jsonl}]",
        ],
    ).trainer.eval_sets
    assert [(s.name, s.n, s.pass_k) for s in sets] == [("aime", 32, (1, 32)), ("m", 1, (1,))]


@pytest.mark.parametrize(
    "sets, message",
    [
        ("[{path: a.jsonl, n: 4}]", r"eval set a: n=4 at temperature 0 samples the same greedy"),
        ("[{path: a.jsonl, n: 4, temperature: 1, pass_k: [8]}]", r"pass_k \[8\] outside 1..n=4"),
        ("[{path: a.jsonl, n: 2.5}]", r"trainer.eval_sets\[0\].n: expected int, got 2.5"),
        (
            "[{path: a.jsonl, tempreature: 1}]",
            r"unknown config key 'trainer.eval_sets\[0\].tempreature'",
        ),
        ("[{path: x/a.jsonl}, {path: y/a.jsonl}]", r"eval_sets: names must differ .*'a', 'a'"),
        ("[{path: a.jsonl, name: 'a b'}]", r"eval set name 'a b': use letters"),
        (
            "[{name: a}]",
            r"trainer.eval_sets\[0\]: .*missing 1 required positional argument: 'path'",
        ),
        ("[{path: ''}]", r"eval set: path is required"),
    ],
)
def test_bad_eval_sets_are_named(sets, message):
    with pytest.raises(ConfigError, match=message):
        load_config("examples/tiny/vapo.yaml", [SETS, f"trainer.eval_sets={sets}"])


def test_eval_data_path_and_eval_sets_together_are_refused():
    with pytest.raises(ConfigError, match="eval_data_path is a shorthand for eval_sets"):
        load_config("examples/tiny/vapo.yaml", ["trainer.eval_sets=[{path: a.jsonl}]"])


def config_for(tiny_model_dir, *overrides):
    return load_config("examples/tiny/vapo.yaml", [f"model.path={tiny_model_dir}", *overrides])


def test_validation_catches_layout_and_batch_mistakes(tiny_model_dir):
    validate_config(config_for(tiny_model_dir), world_size=2)
    with pytest.raises(
        ConfigError, match="tensor_model_parallel_size=3 does not divide num_attention_heads=4"
    ):
        validate_config(
            config_for(tiny_model_dir, "parallel.tensor_model_parallel_size=3"), world_size=3
        )
    with pytest.raises(ConfigError, match=r"ppo_mini_batch_size=64 is not divisible by .* = 3 x 2"):
        validate_config(
            config_for(
                tiny_model_dir, "parallel.tensor_model_parallel_size=1", "actor.micro_batch_size=3"
            ),
            world_size=2,
        )
    with pytest.raises(
        ConfigError, match="rollout_batch_size=3 is not divisible by the data-parallel size 2"
    ):
        validate_config(
            config_for(
                tiny_model_dir,
                "parallel.tensor_model_parallel_size=1",
                "rollout.rollout_batch_size=3",
            ),
            world_size=2,
        )
    with pytest.raises(ConfigError, match="needs rollout.n_samples_per_prompt >= 2"):
        validate_config(
            config_for(
                tiny_model_dir,
                "algorithm.estimator=grpo",
                "rollout.n_samples_per_prompt=1",
                "actor.ppo_mini_batch_size=4",
                "actor.micro_batch_size=4",
            ),
            2,
        )
    with pytest.raises(ConfigError, match=r"unknown 'gea' \(did you mean 'gae'\?\)"):
        validate_config(config_for(tiny_model_dir, "algorithm.estimator=gea"), 2)
    with pytest.raises(ConfigError, match="strategy=balance drops samples"):
        validate_config(
            config_for(
                tiny_model_dir, "algorithm.estimator=grpo", "rollout.rating.strategy=balance"
            ),
            2,
        )
    with pytest.raises(ConfigError, match="critic.optimizer_offload needs model.precision"):
        validate_config(config_for(tiny_model_dir, "critic.optimizer_offload=true"), 2)
    bf16 = config_for(
        tiny_model_dir, "critic.optimizer_offload=true", "model.precision.params_dtype=bfloat16"
    )
    validate_config(bf16, 2)


def test_parameter_offload_of_a_model_the_run_does_not_have_is_refused(tiny_model_dir):
    """vapo.yaml: a critic, no reference (kl_coef 0)."""
    every = ("actor.param_offload=true", "critic.param_offload=true")
    validate_config(config_for(tiny_model_dir, *every), 2)
    with pytest.raises(ConfigError, match="actor.ref_param_offload=true but this run has no"):
        validate_config(config_for(tiny_model_dir, "actor.ref_param_offload=true"), 2)
    validate_config(
        config_for(tiny_model_dir, "actor.ref_param_offload=true", "algorithm.kl_coef=0.01"), 2
    )
    rloo = ("algorithm.estimator=rloo", "critic.pretrain_steps=0")
    with pytest.raises(ConfigError, match=r"critic.param_offload=true .* critic.enable or"):
        validate_config(config_for(tiny_model_dir, *rloo, *every), 2)


def test_critic_and_reference_follow_the_algorithm(tiny_model_dir):
    assert config_for(tiny_model_dir).use_critic
    assert not config_for(tiny_model_dir, "algorithm.estimator=rloo").use_critic
    assert config_for(tiny_model_dir, "algorithm.estimator=rloo", "critic.enable=true").use_critic
    assert not config_for(tiny_model_dir).use_reference  # beta = 0: no reference model at all
    assert config_for(tiny_model_dir, "algorithm.kl_coef=0.01").use_reference


def test_entry_point_fails_on_config_errors_before_building_anything(tiny_model_dir):
    """No torchrun, no process group, no model: the message and exit code come first."""
    for args, message in (
        (["actor.optim.lrr=1"], "did you mean 'actor.optim.lr'"),
        (
            [f"model.path={tiny_model_dir}", "parallel.tensor_model_parallel_size=3"],
            "does not divide num_attention_heads",
        ),
    ):
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "megatron_rl.cli.train",
                "--config",
                "examples/tiny/vapo.yaml",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "WORLD_SIZE": "3"},  # as torchrun would set it for 3 ranks
        )
        assert r.returncode != 0 and message in r.stderr, r.stderr[-2000:]
        assert "config error" in r.stderr


def test_token_budgets_must_hold_the_longest_sequence(tiny_model_dir):
    # the vapo recipe: max_prompt_length 128 + max_new_tokens 16
    dynamic = ("parallel.tensor_model_parallel_size=1", "actor.use_dynamic_bsz=true")
    with pytest.raises(ConfigError, match=r"actor.ppo_max_token_len_per_gpu=100 .* = 144"):
        validate_config(
            config_for(tiny_model_dir, *dynamic, "actor.ppo_max_token_len_per_gpu=100"), 2
        )
    with pytest.raises(ConfigError, match=r"critic.forward_max_token_len_per_gpu=143 "):
        validate_config(
            config_for(
                tiny_model_dir,
                "critic.use_dynamic_bsz=true",
                "critic.forward_max_token_len_per_gpu=143",
            ),
            2,
        )
    # micro_batch_size no longer has to divide the mini-batch once no role splits by it ...
    both = (*dynamic, "critic.use_dynamic_bsz=true", "actor.micro_batch_size=3")
    validate_config(config_for(tiny_model_dir, *both), 2)
    # ... but still does while the critic does
    with pytest.raises(ConfigError, match="not divisible by actor.micro_batch_size"):
        validate_config(config_for(tiny_model_dir, *dynamic, "actor.micro_batch_size=3"), 2)
    with pytest.raises(ValueError, match="log_prob_max_token_len_per_gpu must be >= 1, got 0"):
        config_for(tiny_model_dir, "actor.log_prob_max_token_len_per_gpu=0")


def test_every_input_file_is_named_before_any_process_starts(tiny_model_dir, tmp_path):
    """A missing prompt file, eval set or critic checkpoint is one ConfigError naming its key,
    not a traceback from every rank once the process group is up."""
    missing = tmp_path / "nowhere.jsonl"
    for override, key in (
        (f"data.path={missing}", "data.path"),
        (f"trainer.eval_sets=[{{path: {missing}}}]", r"trainer.eval_sets\[0\].path"),
        (f"model.critic_path={tmp_path / 'no-rm'}", "model.critic_path"),
    ):
        extra = ["trainer.eval_data_path=null"] if "eval_sets" in override else []
        with pytest.raises(ConfigError, match=rf"config key {key}: .*: no such file or directory"):
            validate_config(config_for(tiny_model_dir, *extra, override), world_size=2)
