"""Validation before anything starts: layout, batch sizes, the estimator's needs, and every
input the run reads, each named by its key."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatron_rl.config import ConfigError, load_config, to_dict, validate_config


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


def test_expert_parallelism_and_moe_settings_are_checked_against_the_model(
    tiny_model_dir, family_dir
):
    with pytest.raises(ConfigError, match="expert_model_parallel_size .* the model is dense"):
        validate_config(config_for(tiny_model_dir, "parallel.expert_model_parallel_size=2"), 2)
    moe = family_dir("qwen3-moe")
    tp1_ep2 = ["parallel.tensor_model_parallel_size=1", "parallel.expert_model_parallel_size=2"]
    validate_config(config_for(moe, *tp1_ep2), 2)
    with pytest.raises(ConfigError, match="model.moe is set but .* is dense"):
        validate_config(config_for(tiny_model_dir, "model.moe.freeze_moe_router=true"), 2)
    with pytest.raises(ConfigError, match="rollout.name=hf with a mixture of experts"):
        validate_config(config_for(moe, "rollout.name=hf"), 2)
    with pytest.raises(ConfigError, match="model.use_remove_padding=true with a mixture of"):
        validate_config(config_for(moe, *tp1_ep2, "model.use_remove_padding=true"), 2)
    validate_config(config_for(tiny_model_dir, "model.use_remove_padding=true"), 2)
    with pytest.raises(ConfigError, match=r"actor.router_replay \(mode=R3.* is dense"):
        validate_config(config_for(tiny_model_dir, "actor.router_replay.mode=R3"), 2)
    replay = [*tp1_ep2, "actor.router_replay.mode=R3"]
    validate_config(config_for(moe, *replay), 2)
    with pytest.raises(ConfigError, match="router_replay with async.partial_rollout"):
        apart = ["rollout.placement=disaggregated", "rollout.engine_ranks=1"]
        validate_config(config_for(moe, *replay, *apart, "async.partial_rollout=true"), 3)
    with pytest.raises(ConfigError, match="log_mismatch is for mode disabled"):
        config_for(moe, *replay, "actor.router_replay.log_mismatch=true")
    with pytest.raises(ConfigError, match="tensor_model_parallel_size=2 .* needs sequence_par"):
        validate_config(config_for(moe), 2)  # the recipe's TP 2


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


def test_bypass_mode_needs_log_probs_of_the_distribution_the_trainer_models(tiny_model_dir):
    bypass = "algorithm.rollout_correction.bypass_mode=true"
    validate_config(config_for(tiny_model_dir, bypass), 2)
    for truncated in ("rollout.top_p=0.7", "rollout.top_k=20"):
        with pytest.raises(ConfigError, match=r"bypass_mode=true with rollout.top_p=.*truncated"):
            validate_config(config_for(tiny_model_dir, bypass, truncated), 2)
        validate_config(config_for(tiny_model_dir, truncated), 2)  # without bypass: a warning


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


def test_reward_inputs_are_named_before_any_process_starts(tiny_model_dir, tmp_path):
    """The policy and its tokenizer, a reward model's checkpoint and a python reward's module
    are found now."""
    for override, message in (
        (f"model.path={tmp_path / 'no-policy'}", r"config key model.path: .*no-policy: no such"),
        (
            f"rewards.reward_fns=[{{type: reward_model, model_dir: {tmp_path / 'no-rm'}}}]",
            r"config key rewards.reward_fns\[0\].model_dir: .*no-rm: no such file",
        ),
        (
            "rewards.reward_fns=[{type: math}, {type: python, path: 'no_such_pkg.rw:score'}]",
            r"rewards.reward_fns\[1\].path: no_such_pkg.rw:score: no module 'no_such_pkg.rw'",
        ),
    ):
        config = config_for(tiny_model_dir, override)
        with pytest.raises(ConfigError, match=message):
            validate_config(config, world_size=2)
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    (no_tokenizer / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    with pytest.raises(ConfigError, match=r"config key model.path: .*no-tokenizer: no tokenizer"):
        validate_config(config_for(no_tokenizer), world_size=2)
    good = "rewards.reward_fns=[{type: python, path: 'tests.reward_fns:constant'}]"
    validate_config(config_for(tiny_model_dir, good), world_size=2)


def test_a_disaggregated_placement_is_checked_against_the_launch(tiny_model_dir):
    """Engine ranks leave trainers whose layout and batches must fit the rest of the world;
    what the disaggregated placement does not run is refused by name."""
    dis = ("rollout.placement=disaggregated", "parallel.tensor_model_parallel_size=2")
    validate_config(config_for(tiny_model_dir, *dis, "rollout.engine_ranks=1"), world_size=3)
    validate_config(config_for(tiny_model_dir, *dis, "rollout.engine_ranks=2"), world_size=4)
    validate_config(  # one engine of vLLM TP 2
        config_for(tiny_model_dir, *dis, "rollout.engine_ranks=2",
                   "rollout.vllm_tensor_parallel_size=2"),
        world_size=4,
    )  # fmt: skip
    refused = [
        (("rollout.engine_ranks=3",), 3, r"engine_ranks=3 leaves no training rank .* world of 3"),
        # the trainers' world of 1 cannot hold TP 2
        (("rollout.engine_ranks=1",), 2, "config section parallel: .*world size 1"),
        (("rollout.engine_ranks=3", "rollout.vllm_tensor_parallel_size=2"), 5,
         "engine_ranks=3 is not divisible by rollout.vllm_tensor_parallel_size=2"),
        (("rollout.engine_ranks=3", "rollout.vllm_tensor_parallel_size=3"), 5,
         "vllm_tensor_parallel_size=3 does not divide the model's num_attention_heads=4"),
        (("rollout.engine_ranks=3", "rollout.rollout_batch_size=16"), 5,
         r"rollout_batch_size=16 is not divisible by the 3 engine\(s\)"),
        (("rollout.engine_ranks=1",
          f"rewards.reward_fns=[{{type: reward_model, backend: megatron, model_dir: {tiny_model_dir}}}]"),
         3, r"rewards.reward_fns\[0\] runs on Megatron's model-parallel group"),
    ]  # fmt: skip
    for extra, world, message in refused:
        with pytest.raises(ConfigError, match=message):
            validate_config(config_for(tiny_model_dir, *dis, *extra), world_size=world)


def test_placement_and_engine_ranks_must_agree(tiny_model_dir):
    with pytest.raises(ConfigError, match="engine_ranks=1 needs placement=disaggregated"):
        config_for(tiny_model_dir, "rollout.engine_ranks=1")
    with pytest.raises(ConfigError, match="placement=disaggregated needs engine_ranks >= 1"):
        config_for(tiny_model_dir, "rollout.placement=disaggregated")
    with pytest.raises(ConfigError, match="placement must be one of"):
        config_for(tiny_model_dir, "rollout.placement=apart")


def test_max_staleness_and_partial_rollouts_need_engines_apart_and_vllm(tiny_model_dir):
    """YAML key `async` (a Python keyword: the field is `async_`), read and written back."""
    config = config_for(tiny_model_dir, "async.max_staleness=1")
    assert config.async_.max_staleness == 1 and to_dict(config)["async"] == {
        "max_staleness": 1,
        "partial_rollout": False,
    }
    with pytest.raises(
        ConfigError, match="async.max_staleness=1 needs rollout.placement=disaggregated"
    ):
        validate_config(config, world_size=2)
    with pytest.raises(ConfigError, match="max_staleness=2 needs partial_rollout=true"):
        config_for(tiny_model_dir, "async.max_staleness=2")
    with pytest.raises(ConfigError, match="max_staleness must be >= 0, got -1"):
        config_for(tiny_model_dir, "async.max_staleness=-1")
    config = config_for(tiny_model_dir, "async.max_staleness=2", "async.partial_rollout=true")
    assert to_dict(config)["async"] == {"max_staleness": 2, "partial_rollout": True}
    with pytest.raises(ConfigError, match="partial_rollout=true needs rollout.placement=disagg"):
        validate_config(config_for(tiny_model_dir, "async.partial_rollout=true"), world_size=2)
    apart = ("rollout.placement=disaggregated", "rollout.engine_ranks=1")
    hf = config_for(tiny_model_dir, "async.partial_rollout=true", "rollout.name=hf", *apart)
    with pytest.raises(ConfigError, match="partial_rollout=true needs rollout.name=vllm, got 'hf'"):
        validate_config(hf, world_size=2)


def test_multi_turn_rollouts_are_checked_against_what_they_are_built_for(
    tiny_model_dir, family_dir
):
    on = ["rollout.multi_turn.enable=true", "rollout.multi_turn.max_response_length=96"]
    validate_config(config_for(tiny_model_dir, *on), 2)
    for extra, world, message in [
        (["rollout.placement=disaggregated", "rollout.engine_ranks=1"], 3, "rollout.placement="),
        (["rollout.multi_turn.max_response_length=8"], 2, r"max_new_tokens=\d+ \(one turn\)"),
        (["rollout.max_model_len=100"], 2, r"max_response_length = \d+ is more than .*=100"),
    ]:
        with pytest.raises(ConfigError, match=message):
            validate_config(config_for(tiny_model_dir, *on, *extra), world)
    moe = family_dir("qwen3-moe")
    replay = ["parallel.tensor_model_parallel_size=1", "parallel.expert_model_parallel_size=2",
              "actor.router_replay.mode=R3"]  # fmt: skip
    with pytest.raises(ConfigError, match=r"multi_turn.enable=true does not work with actor"):
        validate_config(config_for(moe, *on, *replay), 2)
    # the longest sequence of the token budgets counts every turn
    budget = ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=200"]
    with pytest.raises(ConfigError, match=r"\+ rollout.multi_turn.max_response_length = \d+"):
        validate_config(config_for(tiny_model_dir, *on, *budget), 2)


@pytest.mark.parametrize(
    "override, message",
    [
        ("rollout.multi_turn.format=mistral", r"'mistral' \(Mistral's \[TOOL_CALLS\]"),
        ("rollout.multi_turn.tool_response_truncate_side=both", "must be one of"),
        ("rollout.multi_turn.max_turns=0", "max_turns must be >= 1"),
        ("rollout.multi_turn.env.type=gym", "type must be one of"),
        ("rollout.multi_turn.env.sandbox.memory_limit_mb=1", "memory_limit_mb"),
        ("rollout.multi_turn.env.sandbox.max_threads=0", "SandboxConfig.max_threads"),
        ("rollout.multi_turn.env.sandbox.run_as_uid=0", "SandboxConfig.run_as_uid"),
        (
            "rollout.multi_turn.env.sandbox.max_thread=8",
            r"did you mean 'rollout.multi_turn.env.sandbox.max_threads'",
        ),
    ],
)
def test_multi_turn_settings_are_refused_by_name(tiny_model_dir, override, message):
    with pytest.raises(ConfigError, match=message):
        config_for(tiny_model_dir, override)


def test_a_teacher_must_read_the_students_tokens_and_the_distillation_estimator_needs_one(
    tiny_model_dir, tiny_teacher_dir, tiny_tools_model_dir, llama_rm_dir, tmp_path
):
    """On-policy distillation: a larger teacher of the student's tokenizer passes; one whose tokenizer, special tokens
    or chat template differ is refused naming what differs; `on_policy_distill` without a
    teacher, or with a critic, is refused."""
    alone = ("algorithm.estimator=on_policy_distill", "critic.pretrain_steps=0")
    validate_config(config_for(tiny_model_dir, *alone, f"teacher.path={tiny_teacher_dir}"), 2)
    with pytest.raises(ConfigError, match=r"on_policy_distill .* set teacher.path"):
        validate_config(config_for(tiny_model_dir, *alone), 2)
    with pytest.raises(ConfigError, match=r"critic.enable=true with .*on_policy_distill"):
        validate_config(
            config_for(
                tiny_model_dir, *alone, f"teacher.path={tiny_teacher_dir}", "critic.enable=true"
            ),
            2,
        )
    # another tokenizer of the same size; Llama-3's special tokens and template
    with pytest.raises(ConfigError, match=r"teacher.path .*not the student's.*vocabulary: 400 vs"):
        validate_config(config_for(tiny_model_dir, f"teacher.path={tiny_tools_model_dir}"), 2)
    with pytest.raises(ConfigError, match=r"eos_token: '<\|im_end\|>' vs .*chat_template differs"):
        validate_config(config_for(tiny_model_dir, f"teacher.path={llama_rm_dir}"), 2)
    with pytest.raises(ConfigError, match=r"config key teacher.path: .*: no such file"):
        validate_config(config_for(tiny_model_dir, f"teacher.path={tmp_path / 'none'}"), 2)
    with pytest.raises(ConfigError, match=r"teacher.param_offload=true without teacher.path"):
        validate_config(config_for(tiny_model_dir, "teacher.param_offload=true"), 2)
    with pytest.raises(ConfigError, match=r"kl_coef must be > 0"):
        config_for(tiny_model_dir, f"teacher.path={tiny_teacher_dir}", "teacher.kl_coef=0")


def test_evaluating_the_teacher_needs_the_students_architecture_and_a_colocated_engine(
    tiny_model_dir, tiny_teacher_dir
):
    """`teacher.evaluate` pushes the teacher's weights into the student's rollout engine:
    a teacher of the student's architecture (here the student's own start) passes; a larger
    one, a disaggregated rollout, no eval set or no teacher is refused by name."""
    same = (f"teacher.path={tiny_model_dir}", "teacher.evaluate=true")
    validate_config(config_for(tiny_model_dir, *same), 2)
    with pytest.raises(ConfigError, match=r"teacher.evaluate=true without teacher.path"):
        validate_config(config_for(tiny_model_dir, "teacher.evaluate=true"), 2)
    larger = (f"teacher.path={tiny_teacher_dir}", "teacher.evaluate=true")
    with pytest.raises(
        ConfigError, match=r"teacher's differs \(num_layers 6 vs 4; hidden_size 192 vs 128"
    ):
        validate_config(config_for(tiny_model_dir, *larger), 2)
    apart = ("rollout.placement=disaggregated", "rollout.engine_ranks=1")
    with pytest.raises(ConfigError, match=r"needs rollout.placement=colocated \(got disaggr"):
        validate_config(config_for(tiny_model_dir, *same, *apart), 3)
    with pytest.raises(ConfigError, match=r"trainer.eval_sets is empty"):
        validate_config(config_for(tiny_model_dir, *same, "trainer.eval_data_path=null"), 2)


def test_a_teacher_on_a_layout_of_its_own_must_fit_the_world_and_be_dense(
    tiny_model_dir, tiny_teacher_dir, family_dir
):
    """`teacher.tensor_model_parallel_size` / `pipeline_model_parallel_size`: the teacher's
    layout (the job's when unset or equal); one that does not fit the world or the teacher's
    heads, a mixture-of-experts teacher, `teacher.evaluate` beside it, a size without a
    teacher or below 1 are refused by name."""
    teacher = f"teacher.path={tiny_teacher_dir}"
    job = config_for(tiny_model_dir, teacher).parallel  # TP 2
    assert config_for(tiny_model_dir, teacher).teacher.layout(job) is job
    same = config_for(tiny_model_dir, teacher, "teacher.tensor_model_parallel_size=2")
    assert same.teacher.layout(job) is job
    own = config_for(
        tiny_model_dir,
        teacher,
        "parallel.sequence_parallel=true",
        "teacher.tensor_model_parallel_size=1",
    )
    layout = own.teacher.layout(own.parallel)
    assert (layout.tensor_model_parallel_size, layout.sequence_parallel) == (1, False)
    assert layout.data_parallel_size(2) == 2
    validate_config(own, 2)
    validate_config(
        config_for(tiny_model_dir, teacher, "teacher.pipeline_model_parallel_size=2"), 4
    )
    with pytest.raises(
        ConfigError,
        match=r"teacher.tensor_model_parallel_size=4, teacher.pipeline_model_parallel_size=None "
        r"\(a layout of its own, beside parallel's TP 2 x PP 1\): world size 2 is not divisible",
    ):
        validate_config(
            config_for(tiny_model_dir, teacher, "teacher.tensor_model_parallel_size=4"), 2
        )
    with pytest.raises(
        ConfigError,
        match=r"teacher.tensor_model_parallel_size=4.*does not divide num_attention_heads=6",
    ):
        validate_config(
            config_for(tiny_model_dir, teacher, "teacher.tensor_model_parallel_size=4"), 4
        )
    moe = config_for(
        tiny_model_dir,
        f"teacher.path={family_dir('qwen3-moe')}",
        "teacher.tensor_model_parallel_size=1",
    )
    with pytest.raises(ConfigError, match=r"with a mixture-of-experts teacher .*leave both unset"):
        validate_config(moe, 2)
    evaluated = config_for(
        tiny_model_dir,
        f"teacher.path={tiny_model_dir}",
        "teacher.evaluate=true",
        "teacher.tensor_model_parallel_size=1",
    )
    validate_config(evaluated, 2)  # its weights pushed with its own groups active
    with pytest.raises(ConfigError, match=r"teacher.pipeline_model_parallel_size is set without"):
        validate_config(config_for(tiny_model_dir, "teacher.pipeline_model_parallel_size=2"), 2)
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size must be a positive integer"):
        config_for(tiny_model_dir, teacher, "teacher.tensor_model_parallel_size=0")


def test_adapters_served_by_vllm_need_a_colocated_vllm_engine_and_a_dense_actor(
    tiny_model_dir, family_dir
):
    """`actor.lora.merge: false` (the engine keeps the base and serves the adapters): refused
    with the HF engine, a disaggregated rollout, a mixture of experts, and on the critic."""
    adapters = ("actor.lora.rank=8", "actor.lora.merge=false")
    validate_config(config_for(tiny_model_dir, *adapters), 2)
    with pytest.raises(ConfigError, match=r"merge=false .* needs rollout.name=vllm, got hf"):
        validate_config(config_for(tiny_model_dir, *adapters, "rollout.name=hf"), 2)
    apart = ("rollout.placement=disaggregated", "rollout.engine_ranks=1")
    with pytest.raises(ConfigError, match=r"needs rollout.placement=colocated \(got disaggr"):
        validate_config(config_for(tiny_model_dir, *adapters, *apart), 3)
    moe = family_dir("qwen3-moe")
    with pytest.raises(ConfigError, match=r"merge=false .* with a mixture of experts"):
        validate_config(config_for(moe, *adapters, "parallel.sequence_parallel=true"), 2)
    with pytest.raises(ConfigError, match=r"critic.lora.merge=false: the critic is never synced"):
        validate_config(
            config_for(tiny_model_dir, "critic.lora.rank=8", "critic.lora.merge=false"), 2
        )
