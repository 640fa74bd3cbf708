"""The learning-rate schedule (`workers/optimizer.py`): megatron-core's OptimizerParamScheduler
over a role's optimizer, counted in optimizer updates, resumed from a checkpoint's count; and
the AdamW kernel `apply_hyperparameters` picks."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from megatron_rl.config import ConfigError, load_config, scheduled_optim, validate_config
from megatron_rl.workers.optimizer import (
    OptimConfig,
    apply_hyperparameters,
    current_lr,
    lr_scheduler,
    resolve_lr_decay_steps,
    restore_schedule,
)


def optimizer(optim: OptimConfig) -> torch.optim.Optimizer:
    """An AdamW with megatron's param-group keys (what get_megatron_optimizer builds): a
    decayed group and a no-decay one (biases, norms: wd_mult 0)."""
    weight, bias = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))
    groups = [
        {"params": [weight], "wd_mult": 1.0, "default_config": True},
        {"params": [bias], "wd_mult": 0.0, "default_config": True},
    ]
    opt = torch.optim.AdamW(groups, lr=optim.lr, weight_decay=optim.weight_decay)
    apply_hyperparameters(opt, optim)
    return opt


def lrs(optim: OptimConfig, updates: int) -> list[float]:
    """The lr of each of `updates` updates, as TrainableRole.update reads and steps it."""
    opt = optimizer(optim)
    scheduler, out = lr_scheduler(opt, optim), []
    for _ in range(updates):
        out.append(current_lr(opt))
        scheduler.step(1)
    return out


def test_linear_warm_up_then_constant():
    optim = OptimConfig(lr=1e-3, lr_warmup_steps=4, lr_warmup_init=1e-4)
    expected = [1e-4 + (1e-3 - 1e-4) * k / 4 for k in range(5)] + [1e-3] * 3
    torch.testing.assert_close(lrs(optim, 8), expected, rtol=1e-12, atol=0)


def test_the_default_is_the_constant_lr_of_before():
    assert lrs(OptimConfig(lr=3e-4), 5) == [3e-4] * 5


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_decay_after_the_warm_up_reaches_min_lr_and_stays(style):
    optim = OptimConfig(lr=1e-3, lr_warmup_steps=2, lr_decay_style=style, min_lr=1e-4)
    optim = resolve_lr_decay_steps(optim, total_updates=10)
    assert optim.lr_decay_steps == 10
    got = lrs(optim, 13)
    assert got[:3] == pytest.approx([0.0, 5e-4, 1e-3], rel=1e-12)
    ratio = [(k - 2) / 8 for k in range(2, 11)]
    coeff = [1 - r if style == "linear" else 0.5 * (1 + math.cos(math.pi * r)) for r in ratio]
    torch.testing.assert_close(got[2:11], [1e-4 + c * 9e-4 for c in coeff], rtol=1e-12, atol=0)
    assert got[10:] == pytest.approx([1e-4] * 3, rel=1e-12)  # past lr_decay_steps


def test_weight_decay_follows_each_groups_multiplier_under_the_schedule():
    optim = OptimConfig(lr=1e-3, weight_decay=0.1, lr_warmup_steps=2)
    opt = optimizer(optim)
    scheduler = lr_scheduler(opt, optim)
    scheduler.step(1)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([5e-4, 5e-4])


def test_a_resume_mid_warm_up_continues_the_schedule():
    """A checkpoint's update count, restored into a schedule built anew from the config, gives
    the lr the uninterrupted run has at every later update, although the optimizer's own
    state brought back the lr of the update it was saved at."""
    optim = resolve_lr_decay_steps(
        OptimConfig(lr=1e-3, lr_warmup_steps=6, lr_decay_style="cosine", min_lr=1e-5), 12
    )
    uninterrupted = lrs(optim, 12)
    opt = optimizer(optim)
    scheduler = lr_scheduler(opt, optim)
    for _ in range(3):
        scheduler.step(1)
    saved_opt, saved = opt.state_dict(), scheduler.state_dict()
    assert saved["num_steps"] == 3

    resumed = optimizer(optim)
    resumed.load_state_dict(saved_opt)  # the saved groups: lr of update 3
    apply_hyperparameters(resumed, optim)
    scheduler = lr_scheduler(resumed, optim)  # a new run: at update 0 ...
    assert current_lr(resumed) == 0.0
    assert restore_schedule(scheduler, saved) == []  # ... continued from the checkpoint's
    got = []
    for _ in range(9):
        got.append(current_lr(resumed))
        scheduler.step(1)
    torch.testing.assert_close(got, uninterrupted[3:], rtol=1e-12, atol=0)


def test_a_resume_takes_the_configs_schedule_and_says_what_changed():
    before = OptimConfig(lr=1e-3, lr_warmup_steps=4)
    opt = optimizer(before)
    scheduler = lr_scheduler(opt, before)
    scheduler.step(2)
    saved = scheduler.state_dict()
    after = OptimConfig(lr=2e-3, lr_warmup_steps=8)
    opt = optimizer(after)
    scheduler = lr_scheduler(opt, after)
    assert restore_schedule(scheduler, saved) == ["lr_warmup_steps: 4 -> 8"]
    assert current_lr(opt) == pytest.approx(2e-3 * 2 / 8)  # the new schedule at update 2


def test_a_checkpoint_from_before_schedules_starts_at_update_zero():
    optim = OptimConfig(lr=1e-3, lr_warmup_steps=4, lr_warmup_init=1e-4)
    opt = optimizer(optim)
    scheduler = lr_scheduler(opt, optim)
    opt.param_groups[0]["lr"] = 7.0  # what a loaded optimizer state would have set
    assert restore_schedule(scheduler, None) == []
    assert current_lr(opt) == pytest.approx(1e-4) and scheduler.num_steps == 0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"lr_decay_style": "exponential"}, "optim.lr_decay_style 'exponential': expected one"),
        ({"lr_warmup_steps": -1}, "optim.lr_warmup_steps must be >= 0"),
        ({"lr_warmup_init": 2e-3}, "optim.lr_warmup_init must be in [0, lr=0.001]"),
        ({"min_lr": 1e-5}, "optim.min_lr=1e-05 has no effect with lr_decay_style constant"),
        ({"lr_decay_steps": 10}, "optim.lr_decay_steps=10 has no effect with lr_decay_style"),
        ({"lr_decay_style": "cosine", "min_lr": 2e-3}, "optim.min_lr must be in [0, lr=0.001]"),
        (
            {"lr_decay_style": "linear", "lr_warmup_steps": 5, "lr_decay_steps": 5},
            "optim.lr_decay_steps (5) must be greater than lr_warmup_steps (5)",
        ),
    ],
)
def test_settings_no_schedule_can_follow_are_refused(fields, message):
    with pytest.raises(ValueError) as e:
        OptimConfig(lr=1e-3, **fields)
    assert message in str(e.value)


def test_the_runs_updates_resolve_the_decay_and_bound_the_warm_up(tiny_model_dir):
    """Actor: total_steps x ppo_epochs x samples / ppo_mini_batch_size updates; the critic
    also one pass per value-pretraining step. A warm-up the run never ends is refused
    before any process starts."""
    config = load_config(
        "examples/tiny/vapo.yaml",
        [
            f"model.path={tiny_model_dir}",
            "rollout.rollout_batch_size=4",
            "rollout.n_samples_per_prompt=4",
            "actor.ppo_mini_batch_size=8",
            "actor.ppo_epochs=2",
            "trainer.total_steps=5",
            "critic.pretrain_steps=3",
            "actor.optim.lr_decay_style=cosine",
            "critic.optim.lr_decay_style=linear",
        ],
    )
    assert scheduled_optim(config, "actor").lr_decay_steps == 5 * 2 * 16 // 8
    assert scheduled_optim(config, "critic").lr_decay_steps == 5 * 2 * 2 + 3 * 2
    pinned = replace(config.actor, optim=replace(config.actor.optim, lr_decay_steps=7))
    assert scheduled_optim(replace(config, actor=pinned), "actor").lr_decay_steps == 7
    long = replace(config.actor, optim=replace(config.actor.optim, lr_warmup_steps=20))
    with pytest.raises(ConfigError, match=r"actor\.optim\.lr_warmup_steps \(20\) is not below"):
        validate_config(replace(config, actor=long), world_size=2)


def test_fp32_cpu_groups_run_torchs_fused_adamw_the_same_update_after_a_load_too():
    optim = OptimConfig(lr=1e-2, weight_decay=0.1)
    opt = optimizer(optim)
    assert [g["fused"] for g in opt.param_groups] == [True, True]
    weight, bias = (
        p.detach().clone().requires_grad_() for g in opt.param_groups for p in g["params"]
    )
    plain = torch.optim.AdamW(  # torch's CPU default: a loop over the tensors
        [{"params": [weight], "weight_decay": 0.1}, {"params": [bias], "weight_decay": 0.0}],
        lr=optim.lr,
    )
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        for ours, theirs in zip(
            [p for gr in opt.param_groups for p in gr["params"]],
            [p for gr in plain.param_groups for p in gr["params"]],
            strict=True,
        ):
            ours.grad = torch.randn(ours.shape, generator=g)
            theirs.grad = ours.grad.clone()
        opt.step()
        plain.step()
    for ours, theirs in zip(opt.param_groups, plain.param_groups, strict=True):
        torch.testing.assert_close(ours["params"][0], theirs["params"][0], rtol=1e-6, atol=1e-7)
    # a checkpoint saved by another kernel choice brings its own back: the choice is re-made
    saved = opt.state_dict()
    saved["param_groups"][0]["fused"] = None
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["fused"] is None
    apply_hyperparameters(opt, optim)
    assert [g["fused"] for g in opt.param_groups] == [True, True]


def test_a_group_off_the_cpu_gets_torchs_default_kernel_back():
    optim = OptimConfig()
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2, device="meta"))], fused=None)
    opt.param_groups[0]["fused"] = True  # as a CPU run's checkpoint would bring it
    apply_hyperparameters(opt, optim)
    assert opt.param_groups[0]["fused"] is None


def test_a_strided_parameter_gradient_or_moment_keeps_the_loop():
    """torch's fused CPU AdamW updates a strided tensor wrong (a TP shard sliced from a whole
    tensor): its group keeps the loop, and the update stays right."""
    optim = OptimConfig(lr=1e-2, weight_decay=0.0, adam_eps=1e-3)
    shard = torch.nn.Parameter(torch.randn(8, 352)[:, 176:])  # a view: not contiguous
    strided_grad = torch.nn.Parameter(torch.randn(8, 176))
    strided_grad.main_grad = torch.randn(176, 8).t()
    for p in (shard, strided_grad):
        opt = torch.optim.AdamW([p], lr=optim.lr, eps=optim.adam_eps, weight_decay=0.0)
        apply_hyperparameters(opt, optim)
        assert opt.param_groups[0]["fused"] is None
        p.grad = torch.randn(p.shape) if p is shard else p.main_grad
        before = p.detach().clone()
        opt.step()
        # |g| >> eps: the first step moves every element by lr against its gradient's sign
        assert torch.equal((p.detach() - before).sign(), -p.grad.sign())
    # a moment loaded strided (a checkpoint's tensors as they came)
    p = torch.nn.Parameter(torch.randn(8, 176))
    opt = torch.optim.AdamW([p])
    opt.state[p] = {"exp_avg": torch.zeros(176, 8).t(), "step": torch.tensor(0.0)}
    apply_hyperparameters(opt, optim)
    assert opt.param_groups[0]["fused"] is None
