"""The run's sections: the recipes' settings, eval sets, the actor/critic role base."""

from __future__ import annotations

import pytest

from megatron_rl.config import (
    LOGGERS,
    ActorConfig,
    ConfigError,
    CriticConfig,
    RoleConfig,
    load_config,
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


def test_actor_and_critic_share_the_role_fields_under_their_own_keys():
    c = load_config(
        "examples/tiny/vapo.yaml",
        [
            "actor.use_dynamic_bsz=true",
            "actor.ppo_max_token_len_per_gpu=300",
            "actor.log_prob_max_token_len_per_gpu=600",
            "critic.use_dynamic_bsz=true",
            "critic.forward_max_token_len_per_gpu=500",
            "critic.grad_offload=true",
        ],
    )
    assert isinstance(c.actor, RoleConfig) and isinstance(c.critic, RoleConfig)
    assert (c.actor.token_budget(), c.actor.token_budget(forward=True)) == (300, 600)
    assert (c.critic.token_budget(), c.critic.token_budget(forward=True)) == (16384, 500)
    assert c.critic.grad_offload and not c.actor.grad_offload
    assert (ActorConfig().optim.lr, CriticConfig().optim.lr) == (1e-6, 2e-6)  # per role
    assert load_config(None).actor.token_budget() is None
    with pytest.raises(ConfigError, match="forward_max_token_len_per_gpu must be >= 1, got 0"):
        load_config(None, ["critic.forward_max_token_len_per_gpu=0"])
    with pytest.raises(ConfigError, match="unknown config key 'actor.forward_max_token_len"):
        load_config(None, ["actor.forward_max_token_len_per_gpu=8"])


def test_logger_names_are_the_backends_the_trainer_builds():
    from megatron_rl.trainer.loggers import BACKENDS

    assert set(LOGGERS) == {"console", "jsonl", *BACKENDS}
