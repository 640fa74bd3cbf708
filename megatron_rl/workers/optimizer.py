"""The optimizer of a trainable role: megatron DDP around its model chunks, megatron's AdamW
(gradient clipping over every TP/PP/DP shard) and megatron's learning-rate schedule
(`OptimizerParamScheduler`: linear warm-up, then constant, linear or cosine decay to a minimum).

The schedule counts optimizer updates: megatron's iterations, the x-axis of the VAPO paper's
Figure 1 ("5,000 update steps"). A rollout step makes ppo_epochs x (samples per step /
ppo_mini_batch_size) of them: DAPO's warm-up over 20 rollout steps of 512 x 16 samples in
mini-batches of 512 is lr_warmup_steps 320."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from megatron_rl.models.dist_checkpoint import inner_optimizers

LR_DECAY_STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class OptimConfig:
    """AdamW through megatron's optimizer (VAPO: actor lr 1e-6, critic lr 2e-6)."""

    lr: float = 1e-6
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Global gradient-norm clip (over all TP/PP/DP shards)."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over DP (needs CUDA in megatron-core 0.16)."""
    lr_warmup_steps: int = 0
    """Linear warm-up from lr_warmup_init to lr over this many optimizer updates (0: none)."""
    lr_warmup_init: float = 0.0
    """The learning rate of the first update of a warm-up."""
    lr_decay_style: str = "constant"
    """After the warm-up: constant (lr), or linear / cosine from lr down to min_lr at
    lr_decay_steps, min_lr after that (verl's and megatron's names)."""
    lr_decay_steps: int | None = None
    """Updates by which a linear or cosine decay reaches min_lr; None: the run's last update
    (`resolve_lr_decay_steps`)."""
    min_lr: float = 0.0
    """Where a linear or cosine decay ends."""

    def __post_init__(self) -> None:
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(
                f"optim.lr_decay_style {self.lr_decay_style!r}: expected one of {LR_DECAY_STYLES}"
            )
        if self.lr_warmup_steps < 0:
            raise ValueError(f"optim.lr_warmup_steps must be >= 0, got {self.lr_warmup_steps}")
        if not 0 <= self.lr_warmup_init <= self.lr:
            raise ValueError(
                f"optim.lr_warmup_init must be in [0, lr={self.lr}], got {self.lr_warmup_init}"
            )
        if self.lr_decay_style == "constant":
            # Nothing would read them: refuse rather than ignore.
            for name, unused in (("min_lr", self.min_lr), ("lr_decay_steps", self.lr_decay_steps)):
                if unused:
                    raise ValueError(
                        f"optim.{name}={unused} has no effect with lr_decay_style constant; "
                        "use linear or cosine, or leave it out"
                    )
        elif not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"optim.min_lr must be in [0, lr={self.lr}], got {self.min_lr}")
        if self.lr_decay_steps is not None and self.lr_decay_steps <= self.lr_warmup_steps:
            raise ValueError(
                f"optim.lr_decay_steps ({self.lr_decay_steps}) must be greater than "
                f"lr_warmup_steps ({self.lr_warmup_steps})"
            )


def resolve_lr_decay_steps(optim: OptimConfig, total_updates: int) -> OptimConfig:
    """`optim` with lr_decay_steps set to the run's `total_updates` where it was left None.
    A warm-up the run never finishes is refused: its schedule would never reach lr."""
    if optim.lr_warmup_steps >= total_updates and optim.lr_warmup_steps:
        raise ValueError(
            f"optim.lr_warmup_steps ({optim.lr_warmup_steps}) is not below the run's "
            f"{total_updates} optimizer updates: the learning rate would never reach lr"
        )
    if optim.lr_decay_steps is not None or optim.lr_decay_style == "constant":
        return optim
    return replace(optim, lr_decay_steps=total_updates)


def wrap_ddp_and_optimizer(chunks: list, optim: OptimConfig):
    """Wrap chunks in megatron DDP and build the optimizer and its learning-rate schedule;
    returns (ddp_chunks, optimizer, scheduler)."""
    # megatron loads only where it is used (CLI start-up, --help and config errors stay fast)
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = chunks[0].config
    if optim.use_distributed_optimizer and not torch.cuda.is_available():
        raise ValueError(
            "use_distributed_optimizer=True needs CUDA: megatron-core's distributed optimizer "
            "refuses CPU tensors; use it on GPU or set it to False"
        )
    if config.bf16 and not torch.cuda.is_available():
        raise ValueError("bf16 training needs CUDA (megatron's bf16 optimizer); use fp32 on CPU")
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=optim.use_distributed_optimizer,
    )
    wrapped = [
        DistributedDataParallel(
            config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0
        )
        for i, chunk in enumerate(chunks)
    ]
    config.finalize_model_grads_func = finalize_model_grads
    no_sync = [c.no_sync for c in wrapped]
    config.no_sync_func = no_sync if len(no_sync) > 1 else no_sync[0]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=optim.lr,
            weight_decay=optim.weight_decay,
            adam_beta1=optim.adam_beta1,
            adam_beta2=optim.adam_beta2,
            adam_eps=optim.adam_eps,
            clip_grad=optim.clip_grad,
            min_lr=optim.min_lr,
            bf16=config.bf16,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=optim.use_distributed_optimizer,
        ),
        wrapped,
        # platform.initialize builds megatron's extra gloo groups only next to NCCL.
        use_gloo_process_groups=torch.cuda.is_available(),
    )
    apply_hyperparameters(optimizer, optim)
    return wrapped, optimizer, lr_scheduler(optimizer, optim)


def lr_scheduler(optimizer, optim: OptimConfig):
    """megatron-core's OptimizerParamScheduler for `optim` (its lr_decay_steps resolved);
    `step(1)` after every optimizer update sets each param group's lr (and weight decay, times
    the group's `wd_mult`: none on biases and norms)."""
    # megatron loads only where it is used (CLI start-up, --help and config errors stay fast)
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    # megatron needs decay steps past the warm-up even where the style never decays.
    decay_steps = optim.lr_decay_steps or optim.lr_warmup_steps + 1
    return OptimizerParamScheduler(
        optimizer,
        init_lr=optim.lr_warmup_init,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=optim.lr_warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=optim.lr_decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
        # What a run is configured with wins over what its checkpoint was (`restore_schedule`).
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )


def current_lr(optimizer) -> float:
    """The learning rate the schedule set for this update (megatron's canonical one)."""
    # megatron loads only where it is used (CLI start-up, --help and config errors stay fast)
    from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging

    return get_canonical_lr_for_logging(optimizer.param_groups)


def step_with_grad_norm(optimizer, grad_norm: float) -> bool:
    """megatron-core's optimizer step (`ChainedOptimizer.step`) given the gradient norm the
    caller took after `prepare_grads`: each optimizer of the chain with `clip_grad` > 0
    scales its gradients by clip_grad / grad_norm where that is < 1, then all step. Returns
    whether the step was taken. `step()` itself would prepare the gradients and take the
    norm again: a second pass over every gradient and a second host synchronisation.

    Where every group of an optimizer runs torch's fused AdamW (`use_fused_adamw`), the
    scaling goes into its step instead (the kernel's `grad_scale`, which GradScaler uses to
    unscale: the gradient divided by 1 / coefficient as the kernel reads it), not a pass of
    its own over every gradient beforehand: the plain-PyTorch step of `tools.bench
    train_step` makes no such pass."""
    # why: megatron loads only where it is used; the CPU layer may have replaced the clip
    from megatron.core.optimizer import clip_grads

    scaled = []
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(inner, "is_stub_optimizer", False) or inner.config.clip_grad <= 0.0:
            continue
        params = inner.get_parameters()
        coeff = inner.config.clip_grad / (grad_norm + 1.0e-6)  # megatron's clip coefficient
        if not params or coeff >= 1.0:
            continue
        decoupled = inner.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
        if not decoupled and _steps_fused(inner.optimizer):
            inner.optimizer.grad_scale = torch.full((), 1.0 / coeff, device=params[0].device)
            scaled.append(inner.optimizer)
        else:
            clip_grads.clip_grad_by_total_norm_fp32(
                params, inner.config.clip_grad, grad_norm, use_decoupled_grad=decoupled
            )
    try:
        return optimizer.step_with_ready_grads()
    finally:
        for torch_optimizer in scaled:  # read at every step: this one's only
            del torch_optimizer.grad_scale


def _steps_fused(torch_optimizer) -> bool:
    """Whether every group of a torch optimizer runs the fused kernel, the only one that
    takes a `grad_scale` (torch's Adam refuses it elsewhere)."""
    groups = getattr(torch_optimizer, "param_groups", [])
    return bool(groups) and all(g.get("fused") is True for g in groups)


def use_fused_adamw(optimizer) -> None:
    """Where megatron-core fell back to torch's AdamW (no Transformer Engine, no apex), run
    torch's fused kernel: the same update in one pass over each tensor, as the plain-PyTorch
    peer of `tools.bench train_step` runs it. torch's default is otherwise foreach kernels
    on CUDA (a pass per op of the update over every tensor: 10.9 ms of a 0.5B model's step
    on an H200, `bench/gpu.md`) and a dozen Python-dispatched ops per parameter on the CPU.
    Taken by a group whose parameters are fp32 on the CPU, or floating on CUDA (bf16
    training steps fp32 master weights), and only where every parameter, its DDP gradient
    (`main_grad`) and its moments are contiguous: torch 2.13's CPU kernel silently updates
    a strided tensor wrong (a TP shard of a LoRA A sliced from the whole is one;
    `tests/workers/test_lr_schedule_unit.py`), and the CUDA one walks tensors as flat
    memory. Set on the group, which torch reads at every step and a checkpoint's groups
    bring back: elsewhere it is put back to torch's default (None), whatever the checkpoint
    says. Each parameter's step count goes where the chosen kernel reads it (`_place_steps`)."""
    for inner in inner_optimizers(optimizer):
        for group in inner.param_groups:
            if "fused" not in group or group.get("foreach") or group["differentiable"]:
                continue  # not torch's Adam, or a variant the fused kernel does not run
            params = group["params"]
            tensors = [
                t
                for p in params
                for t in (p, getattr(p, "main_grad", p), *inner.state.get(p, {}).values())
                if torch.is_tensor(t)
            ]
            fits = all(_fused_kernel_runs(p) for p in params)
            fits = fits and all(t.is_contiguous() for t in tensors)
            group["fused"] = True if params and fits else None
            _place_steps(inner, group)


def _fused_kernel_runs(p: torch.Tensor) -> bool:
    if p.device.type == "cuda":
        return p.is_floating_point()
    return p.device.type == "cpu" and p.dtype == torch.float32


def _place_steps(inner, group) -> None:
    """Each parameter's step count where its group's kernel reads it, as torch places it
    for a new state: float32 on the parameter's device for the fused (or capturable)
    kernel (the CUDA one reads it in device memory), on the host otherwise (the foreach
    path reads it as a number: on the device, one host synchronisation per parameter). A
    checkpoint of the other choice brings its steps back where that one had them."""
    on_device = group["fused"] or group.get("capturable")
    for p in group["params"]:
        state = inner.state.get(p, {})
        if torch.is_tensor(state.get("step")):
            where = p.device if on_device else torch.device("cpu")
            state["step"] = state["step"].to(device=where, dtype=torch.float32)


def restore_schedule(scheduler, saved: dict | None) -> list[str]:
    """Continue `scheduler` (built from this run's config) from the update count of a
    checkpoint's schedule (`saved`; None: the checkpoint predates schedules, counted from 0).
    The config's warm-up and decay win, like every optimizer setting on resume; the returned
    "name: old -> new" lines say which differ from the checkpoint's (the bounds, max_lr and
    min_lr, are `apply_hyperparameters`' to report)."""
    now = scheduler.state_dict()
    keys = ["lr_warmup_steps", "lr_decay_style"]
    if now["lr_decay_style"] != "constant":  # else its decay steps are a placeholder
        keys.append("lr_decay_steps")
    changed = [
        f"{key}: {saved[key]} -> {now[key]}"
        for key in keys
        if saved is not None and key in saved and saved[key] != now[key]
    ]
    scheduler.num_steps = 0 if saved is None else int(saved["num_steps"])
    scheduler.step(0)  # sets every group's lr (the optimizer's state brought back the saved one)
    return changed


def apply_hyperparameters(optimizer, optim: OptimConfig) -> list[str]:
    """Set every param group's schedule bounds (max_lr, min_lr: the scheduler multiplies
    neither), weight decay, betas and eps from `optim`, with megatron's per-group `wd_mult`
    (0: no weight decay on biases and norms). Called when the optimizer is built and again
    after a checkpoint's state is loaded, whose param groups would bring back the saved
    values: the config wins. The lr itself is the scheduler's (`restore_schedule`). Also
    picks the AdamW kernel (`use_fused_adamw`), which a loaded group resets. Returns
    "name: old -> new" per changed value."""
    use_fused_adamw(optimizer)
    changed: dict[str, tuple] = {}
    for group in optimizer.param_groups:
        wanted = {
            "max_lr": optim.lr,
            "min_lr": optim.min_lr,
            "weight_decay": optim.weight_decay * group.get("wd_mult", 1.0),
            "betas": (optim.adam_beta1, optim.adam_beta2),
            "eps": optim.adam_eps,
        }
        for key, value in wanted.items():
            if group.get(key) != value:
                changed.setdefault(key, (group.get(key), value))
                group[key] = value
    return [f"{key}: {old} -> {new}" for key, (old, new) in changed.items()]
