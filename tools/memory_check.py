"""The memory planner's estimate against the tensors a real actor holds on this CPU.

    python -m tools.plan_memory --check-cpu
    torchrun --nproc-per-node 2 -m tools.memory_check --tp 2 --sequence-parallel

Builds the tiny Megatron actor (fp32, the `local` activation profile) for each recompute
setting, and with the head's logits recomputed too (`logits_checkpointing`), runs one PPO update with one micro-batch from the same initial weights (the loss
and grad norm are printed: recompute must not change them), and measures
  - model states: bytes of the parameters, DDP's fp32 grad buffers and the optimizer's
    state tensors after the step (each storage counted once);
  - activations: bytes of every tensor saved for backward (saved-tensor hooks, parameters
    excluded, each storage once) during the forward, plus, with recompute, the largest
    single recomputation in backward (one layer, or one attention core).
Each is compared with `megatron_rl.memory_plan`; prints one JSON line per setting and exits
1 when a ratio of rank 0 leaves [1 - tol, 1 + tol], or one of another rank falls below 1 - tol:
the plan is of the busiest rank, and under TP the first holds the most real vocabulary rows
(the padding is at the end), whose probabilities the head keeps for backward.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from megatron_rl.memory_plan import (
    MemoryPlanConfig,
    activation_bytes,
    model_state_bytes,
    stage_params,
)
from megatron_rl.procutil import exit_now


def _storages(tensors) -> dict[int, int]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def measured_states(actor) -> dict[str, int]:
    params = [p for c in actor.chunks for p in c.parameters()]
    grads = [p.main_grad for p in params if getattr(p, "main_grad", None) is not None]
    optimizers = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    state = [
        t
        for opt in optimizers
        for per_param in opt.optimizer.state.values()
        for t in per_param.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0  # skip the scalar step counters
    ]
    return {
        "weights": sum(_storages(params).values()),
        "grads": sum(_storages(grads).values()),
        "optimizer": sum(_storages(state).values()),
    }


class SavedTensorMeter:
    """Bytes saved for backward: in the forward (all alive at once, so each storage counts
    once), and per recompute in backward (grouped by the autograd node recomputing: a
    recomputed layer's tensors are freed before the next one, and addresses get reused)."""

    def __init__(self, exclude: set[int]):
        self.exclude = exclude
        self.forward: dict[int, int] = {}
        self.recomputed: dict[int, dict[int, int]] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.exclude:
            node = torch._C._current_autograd_node()
            group = self.forward if node is None else self.recomputed.setdefault(id(node), {})
            group.setdefault(ptr, storage.nbytes())
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    @property
    def peak_bytes(self) -> int:
        """What the forward saved plus the largest single recompute."""
        recompute = max((sum(g.values()) for g in self.recomputed.values()), default=0)
        return sum(self.forward.values()) + recompute


def check(recompute: str | None, logits_checkpointing: bool, a, ctx) -> dict:
    from megatron_rl.models.gpt import RecomputeConfig
    from megatron_rl.models.presets import preset_arch
    from megatron_rl.workers.losses_config import PolicyLossConfig
    from megatron_rl.workers.optimizer import OptimConfig
    from megatron_rl.workers.policy import Actor
    from megatron_rl.workers.spec import RoleModel
    from tools.bench_train_step import synthetic_batch

    arch = preset_arch("tiny")
    torch.manual_seed(0)  # the same initial weights for every recompute setting
    actor = Actor(
        RoleModel(arch, ctx.layout, recompute=RecomputeConfig(recompute)),
        optim=OptimConfig(),
        logits_checkpointing=logits_checkpointing,
    )
    batch = synthetic_batch(arch, a.micro_batch_size, a.seq_length, seed=ctx.dp_rank)
    params = [p for c in actor.chunks for p in c.parameters()]
    meter = SavedTensorMeter({p.untyped_storage().data_ptr() for p in params})
    with meter.hooks():
        metrics = actor.update(batch, PolicyLossConfig(nll_coef=0.1), num_microbatches=1)

    plan_config = MemoryPlanConfig(
        tensor_model_parallel_size=ctx.layout.tensor_model_parallel_size,
        sequence_parallel=ctx.layout.sequence_parallel,
        data_parallel_size=ctx.dp_size,
        use_distributed_optimizer=False,
        micro_batch_size=a.micro_batch_size,
        num_microbatches=1,
        seq_length=a.seq_length,
        recompute_granularity=recompute,
        logits_checkpointing=logits_checkpointing,
        params_dtype="fp32",
        profile="local",
    )
    estimated = model_state_bytes(stage_params(arch, plan_config, "actor"), plan_config, True)
    estimated["activations"] = activation_bytes(arch, plan_config, "actor")
    measured = measured_states(actor)
    measured["activations"] = meter.peak_bytes
    measured["recomputes"] = len(meter.recomputed)
    return {
        "recompute": recompute or "none",
        "logits_checkpointing": logits_checkpointing,
        "rank": ctx.rank,
        # Recompute must not change the numbers: the same step from the same weights.
        "grad_norm": metrics["grad_norm"],
        "pg_loss": metrics["pg_loss"],
        **{f"{k}_estimated": estimated[k] for k in estimated},
        **{f"{k}_measured": measured[k] for k in measured},
        **{f"{k}_ratio": round(estimated[k] / measured[k], 4) for k in estimated},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--tolerance", type=float, default=0.02)
    a = p.parse_args(argv)

    from megatron_rl.models.presets import preset_arch
    from megatron_rl.parallel import distributed

    os.environ.setdefault("MASTER_PORT", "29517")
    layout = distributed.ParallelLayout(
        tensor_model_parallel_size=a.tp, sequence_parallel=a.sequence_parallel
    )
    ctx = distributed.initialize(layout, arch=preset_arch("tiny"))
    ok = True
    for recompute, logits in ((None, False), ("selective", False), ("full", False), (None, True)):
        row = check(recompute, logits, a, ctx)
        low, high = 1 - a.tolerance, 1 + a.tolerance if ctx.rank == 0 else float("inf")
        ok &= all(low <= v <= high for k, v in row.items() if k.endswith("_ratio"))
        if ctx.rank == 0:
            print(json.dumps(row), flush=True)
    distributed.destroy()
    return 0 if ok else 1


if __name__ == "__main__":
    exit_now(main())  # past the interpreter's teardown of torch, megatron and vLLM
