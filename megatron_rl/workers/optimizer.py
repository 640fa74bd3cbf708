"""The optimizer of a trainable role: megatron DDP around its model chunks and megatron's
AdamW (gradient clipping over every TP/PP/DP shard)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


def wrap_ddp_and_optimizer(chunks: list, optim: OptimConfig):
    """Wrap chunks in megatron DDP and build the optimizer; returns (ddp_chunks, optimizer)."""
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
            bf16=config.bf16,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=optim.use_distributed_optimizer,
        ),
        wrapped,
        # platform.initialize builds megatron's extra gloo groups only next to NCCL.
        use_gloo_process_groups=torch.cuda.is_available(),
    )
    apply_hyperparameters(optimizer, optim)
    return wrapped, optimizer


def apply_hyperparameters(optimizer, optim: OptimConfig) -> list[str]:
    """Set every param group's lr, weight decay, betas and eps from `optim`, with megatron's
    per-group multipliers (`wd_mult` 0: no weight decay on biases and norms, as megatron-LM's
    scheduler sets it; this trainer runs without that scheduler). Called when the optimizer
    is built and again after a checkpoint's state is loaded, whose param groups would bring
    back the saved values: the config wins. Returns "name: old -> new" per changed value."""
    changed: dict[str, tuple] = {}
    for group in optimizer.param_groups:
        wanted = {
            "lr": optim.lr * group.get("lr_mult", 1.0),
            "weight_decay": optim.weight_decay * group.get("wd_mult", 1.0),
            "betas": (optim.adam_beta1, optim.adam_beta2),
            "eps": optim.adam_eps,
        }
        for key, value in wanted.items():
            if group.get(key) != value:
                changed.setdefault(key, (group.get(key), value))
                group[key] = value
    return [f"{key}: {old} -> {new}" for key, (old, new) in changed.items()]
