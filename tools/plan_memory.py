"""Per-GPU memory of an RL step (actor + critic + reference + colocated vLLM): does it fit?

    python -m tools.plan_memory --model qwen2.5-32b --tp 8 --pp 2,4 --dp 2,4 \\
        --seq-length 22528 --recompute none,full --vllm-gpu-memory-utilization 0.5
    python -m tools.plan_memory --model qwen2.5-32b --recipe examples/qwen2.5-32b/vapo.yaml --dp 2
    python -m tools.plan_memory --model qwen3-30b-a3b --recipe examples/qwen3-30b-a3b/grpo.yaml
        --dp 4,8                                 # a mixture of experts: --ep, --etp too
    python -m tools.plan_memory --check-cpu      # the estimate vs tracked tensors on this CPU

--model is a preset (tiny, qwen2.5-0.5b, qwen2-1b, qwen2.5-7b, qwen2.5-32b, qwen3-30b-a3b, ...)
or a Hugging Face config.json / checkpoint directory. Comma lists (--tp, --pp, --dp, --ep, --recompute,
--vllm-gpu-memory-utilization, --micro-batch-size) sweep every combination and print one
markdown row each; a single combination also prints its breakdown. --recipe takes layout,
lengths, batch sizes, optimizer sharding, recompute, critic/reference, offload and vLLM
settings from a training YAML. --offload params,grads,optimizer (or state keys such as
critic_weights; none for nothing) says what leaves the device while vLLM generates, for
every role that has it, in place of the recipe's. The formulas: `megatron_rl/memory_plan.py`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

from megatron_rl.memory_plan import (
    OFFLOADABLE,
    GiB,
    MemoryPlanConfig,
    PlanError,
    plan_memory,
    summary_row,
)
from megatron_rl.models.presets import resolve_arch


def _list(kind):
    def parse(text: str) -> list:
        return [kind(x) for x in text.split(",")]

    return parse


def _recompute(text: str) -> str | None:
    return None if text in ("none", "") else text


def recipe_offload(c) -> tuple[str, ...]:
    """`MemoryPlanConfig.offload` of a TrainConfig's *_offload settings."""
    asked = {
        "actor_weights": c.actor.param_offload,
        "actor_grads": c.actor.grad_offload,
        "actor_optimizer": c.actor.optimizer_offload,
        "critic_weights": c.use_critic and c.critic.param_offload,
        "critic_grads": c.use_critic and c.critic.grad_offload,
        "critic_optimizer": c.use_critic and c.critic.optimizer_offload,
        "reference_weights": c.use_reference and c.actor.ref_param_offload,
        "teacher_weights": c.use_teacher and c.teacher.param_offload,
    }
    return tuple(k for k, on in asked.items() if on)


def offload_keys(
    text: str, critic: bool, reference: bool, teacher: bool = False
) -> tuple[str, ...]:
    """--offload: kinds (params, grads, optimizer) for every role the plan has, or state keys."""
    kinds = {"params": "weights", "grads": "grads", "optimizer": "optimizer"}
    roles = ["actor"] + ["critic"] * critic + ["reference"] * reference + ["teacher"] * teacher
    out = []
    for item in filter(None, text.split(",")):
        if item == "none":
            continue
        if item in kinds:
            out += [f"{r}_{kinds[item]}" for r in roles if kinds[item] in OFFLOADABLE[r]]
        else:
            out.append(item)  # a state key, checked by MemoryPlanConfig
    return tuple(dict.fromkeys(out))


def recipe_settings(path: str) -> dict:
    """MemoryPlanConfig fields a training YAML determines."""
    from megatron_rl.config import load_config

    c = load_config(path)
    p = c.parallel
    return dict(
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
        sequence_parallel=p.sequence_parallel,
        expert_model_parallel_size=p.expert_model_parallel_size,
        expert_tensor_parallel_size=p.expert_tensor_parallel_size,
        use_distributed_optimizer=c.actor.optim.use_distributed_optimizer,
        micro_batch_size=c.actor.micro_batch_size,
        seq_length=c.data.max_prompt_length + c.rollout.max_new_tokens,
        max_tokens_per_micro_batch=c.actor.token_budget(),
        recompute_granularity=c.model.recompute.granularity,
        logits_checkpointing=c.actor.logits_checkpointing,
        fp8=c.model.precision.fp8 is not None,
        params_dtype="bf16" if c.model.precision.bf16 else "fp32",
        critic=c.use_critic,
        reference=c.use_reference,
        vllm_gpu_memory_utilization=c.rollout.gpu_memory_utilization,
        vllm_tensor_parallel_size=c.rollout.vllm_tensor_parallel_size,
        offload=recipe_offload(c),
        lora_rank=recipe_lora_rank(c),
        **({"teacher": recipe_teacher(c)} if c.use_teacher else {}),
        teacher_tensor_model_parallel_size=c.teacher.tensor_model_parallel_size,
        teacher_pipeline_model_parallel_size=c.teacher.pipeline_model_parallel_size,
    )


def recipe_teacher(c):
    """The architecture of the recipe's `teacher.path`, when it is on this machine (else
    `--teacher` names it)."""
    from pathlib import Path

    from megatron_rl.models.source import ModelSource

    return ModelSource(c.teacher.path).architecture() if Path(c.teacher.path).exists() else None


def recipe_lora_rank(c) -> int:
    """The recipe's LoRA rank: the plan prices one for the actor and the critic."""
    rank = c.actor.lora.rank
    if c.use_critic and c.critic.lora.rank != rank:
        raise ValueError(
            f"actor.lora.rank {rank} and critic.lora.rank {c.critic.lora.rank} differ: the "
            "plan prices one LoRA rank for both (--lora-rank)"
        )
    return rank


def breakdown(plan) -> str:
    lines = [f"  {k:<22} {v / GiB:8.2f} GiB" for k, v in plan.states.items()]
    lines += [f"  {k + '_activations':<22} {v / GiB:8.2f} GiB" for k, v in plan.activations.items()]
    lines.append(f"  {'vllm (generation)':<22} {plan.vllm_bytes / GiB:8.2f} GiB")
    away = ", ".join(plan.config.offload) or "nothing"
    lines.append(f"  offloaded while generating: {away} ({plan.offloaded_bytes / GiB:.2f} GiB)")
    lines.append(f"  host copy to rewind a step's updates: {plan.rewind_host_bytes / GiB:.2f} GiB")
    usable = plan.usable_bytes
    for name, n in (("train", plan.train_bytes), ("rollout", plan.rollout_bytes)):
        lines.append(
            f"  {name} phase {n / GiB:6.2f} GiB, margin {(usable - n) / GiB:6.2f} GiB "
            f"to the usable {usable / GiB:.2f} GiB"
        )
    lines.append(
        f"  peak {plan.peak_bytes / GiB:.2f} GiB of {plan.config.gpu_memory_gib} "
        f"(- {plan.config.reserved_gib} reserved), margin {plan.margin_bytes / GiB:.2f} GiB "
        f"-> {'fits' if plan.fits else 'DOES NOT FIT'}"
    )
    return "\n".join(lines + [f"  note: {n}" for n in plan.notes])


def markdown(rows: list[dict]) -> str:
    keys = list(rows[0])
    out = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    out += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-32b")
    p.add_argument("--recipe", help="training YAML to take the settings from")
    p.add_argument("--tp", type=_list(int))
    p.add_argument("--pp", type=_list(int))
    p.add_argument("--vpp", type=int)
    p.add_argument("--dp", type=_list(int), default=[1])
    p.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction)
    p.add_argument("--ep", type=_list(int), help="expert-parallel size(s), MoE models")
    p.add_argument("--etp", type=int, help="expert-tensor-parallel size (default: --tp)")
    p.add_argument("--distributed-optimizer", action=argparse.BooleanOptionalAction)
    p.add_argument("--micro-batch-size", type=_list(int))
    p.add_argument("--num-microbatches", type=int, default=64)
    p.add_argument("--seq-length", type=int)
    p.add_argument(
        "--max-tokens-per-micro-batch",
        type=int,
        help="use_dynamic_bsz: the token budget (actor.ppo_max_token_len_per_gpu)",
    )
    p.add_argument("--recompute", type=_list(_recompute), help="none, selective, full")
    p.add_argument(
        "--logits-checkpointing",
        action=argparse.BooleanOptionalAction,
        help="actor.logits_checkpointing: the head keeps no probabilities for backward",
    )
    p.add_argument("--fp8", action=argparse.BooleanOptionalAction)
    p.add_argument("--params-dtype", choices=["bf16", "fp32"])
    p.add_argument("--profile", choices=["te", "local"], default="te")
    p.add_argument("--critic", action=argparse.BooleanOptionalAction)
    p.add_argument("--reference", action=argparse.BooleanOptionalAction)
    p.add_argument(
        "--lora-rank", type=int, help="LoRA on the actor and critic (0: full fine-tuning)"
    )
    p.add_argument(
        "--teacher",
        help="on-policy distillation's teacher: a preset or HF directory, as --model "
        "(default: the recipe's teacher.path when it is here)",
    )
    for key in ("tp", "pp"):
        p.add_argument(
            f"--teacher-{key}",
            type=int,
            help=f"the teacher's own {key.upper()} (default: the recipe's "
            f"teacher.{'tensor' if key == 'tp' else 'pipeline'}_model_parallel_size; 0: the job's)",
        )
    p.add_argument("--vllm-gpu-memory-utilization", type=_list(float))
    p.add_argument("--vllm-tp", type=int)
    p.add_argument("--vllm-sleep-mode", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--gpu-memory-gib", type=float, default=80.0)
    p.add_argument("--reserved-gib", type=float, default=4.0)
    p.add_argument(
        "--offload",
        help="params,grads,optimizer (every role that has them) or state keys "
        "(actor_weights, critic_optimizer, ...); none: nothing. Default: the recipe's",
    )
    p.add_argument("--json", action="store_true", help="one JSON line per combination")
    p.add_argument(
        "--check-cpu",
        action="store_true",
        help="build the tiny actor here and compare the estimate with the tensors it holds",
    )
    a = p.parse_args(argv)

    if a.check_cpu:
        from tools.memory_check import main as check

        return check([])

    try:
        base = recipe_settings(a.recipe) if a.recipe else {}
    except (ValueError, OSError) as e:
        print(f"plan_memory: {e}", file=sys.stderr)
        return 2
    scalars = {
        "virtual_pipeline_model_parallel_size": a.vpp,
        "sequence_parallel": a.sequence_parallel,
        "expert_tensor_parallel_size": a.etp,
        "use_distributed_optimizer": a.distributed_optimizer,
        "num_microbatches": a.num_microbatches,
        "seq_length": a.seq_length,
        "max_tokens_per_micro_batch": a.max_tokens_per_micro_batch,
        "logits_checkpointing": a.logits_checkpointing,
        "fp8": a.fp8,
        "params_dtype": a.params_dtype,
        "profile": a.profile,
        "critic": a.critic,
        "reference": a.reference,
        "lora_rank": a.lora_rank,
        "vllm_tensor_parallel_size": a.vllm_tp,
        "vllm_sleep_mode": a.vllm_sleep_mode,
        "gpu_memory_gib": a.gpu_memory_gib,
        "reserved_gib": a.reserved_gib,
    }
    base.update({k: v for k, v in scalars.items() if v is not None})
    for key, size in (("tensor", a.teacher_tp), ("pipeline", a.teacher_pp)):
        if size is not None:  # 0: on the job's layout
            base[f"teacher_{key}_model_parallel_size"] = size or None
    try:
        if a.teacher:
            base["teacher"] = resolve_arch(a.teacher)
    except ValueError as e:
        print(f"plan_memory: --teacher: {e}", file=sys.stderr)
        return 2
    if "teacher" in base and base["teacher"] is None:
        print(
            "plan_memory: the recipe's teacher.path is not on this machine: name its "
            "architecture with --teacher (a preset or an HF directory)",
            file=sys.stderr,
        )
        return 2
    if a.offload is not None:
        base["offload"] = offload_keys(
            a.offload,
            base.get("critic", True),
            base.get("reference", False),
            base.get("teacher") is not None,
        )
    sweeps = {
        "tensor_model_parallel_size": a.tp,
        "pipeline_model_parallel_size": a.pp,
        "data_parallel_size": a.dp,
        "expert_model_parallel_size": a.ep,
        "micro_batch_size": a.micro_batch_size,
        "recompute_granularity": a.recompute,
        "vllm_gpu_memory_utilization": a.vllm_gpu_memory_utilization,
    }
    sweeps = {k: v for k, v in sweeps.items() if v is not None}
    try:
        arch = resolve_arch(a.model)
        plans = [
            plan_memory(arch, MemoryPlanConfig(**{**base, **dict(zip(sweeps, combo, strict=True))}))
            for combo in itertools.product(*sweeps.values())
        ]
    except (PlanError, ValueError, TypeError) as e:
        print(f"plan_memory: {e}", file=sys.stderr)
        return 2
    rows = [summary_row(plan) for plan in plans]
    if a.json:
        for row in rows:
            print(json.dumps({"model": a.model, **row}))
    else:
        print(f"{a.model}: seq_length {plans[0].config.seq_length}, micro-batch(es) "
              f"{sorted({pl.config.micro_batch_size for pl in plans})}, GiB per GPU")  # fmt: skip
        print(markdown(rows))
        if len(plans) == 1:
            print(breakdown(plans[0]))
    return 0 if all(plan.fits for plan in plans) else 1


if __name__ == "__main__":
    raise SystemExit(main())
