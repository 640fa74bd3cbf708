"""A run assembled from its validated config: `start_rank` makes this rank's `RLTrainer` (or,
on an engine rank of a disaggregated placement, serves the trainers' rollouts), in the order
that makes a bad input fail in seconds, before any model loads:

    config validated; output_dir checked (an earlier run is resumed or replaced, never mixed)
    distributed start-up; tokenizer; prompts
    rollout side, first half: reward pool, tool format, environment workers
    roles (actor, reference, critic, teacher); what they offload leaves the device
    rollout side, second half: the engine (colocated) or the engine ranks (disaggregated)
    the actor's weights into the engines (a Megatron checkpoint: they started from random)
    checkpoints, metrics logger, memory timeline, stop requests; resume from the newest
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import torch

from megatron_rl.config import ConfigError, TrainConfig, scheduled_optim, to_dict, validate_config
from megatron_rl.data import PromptStream, load_prompts
from megatron_rl.models.source import ModelSource
from megatron_rl.parallel import distributed
from megatron_rl.parallel.layout_groups import LayoutGroups
from megatron_rl.preemption import STOP, plain_torchrun_warning
from megatron_rl.rollout.service import (
    EnginesApart,
    RolloutBuilder,
    join_placement,
    prompt_tools,
    serve_engine_rank,
)
from megatron_rl.trainer.checkpoint import (
    CheckpointManager,
    clear_previous_run,
    previous_run_files,
)
from megatron_rl.trainer.memory_timeline import MemoryTimeline
from megatron_rl.trainer.metrics import LoggerConfig, MetricsLogger
from megatron_rl.trainer.offload import Roles
from megatron_rl.trainer.runner import MEMORY_TIMELINE, RLTrainer, RunParts
from megatron_rl.trainer.watchdog import Watchdog, default_store
from megatron_rl.workers.critic import Critic
from megatron_rl.workers.own_layout import OnOwnLayout
from megatron_rl.workers.policy import Actor, AdapterOffReference, ReferencePolicy
from megatron_rl.workers.spec import RoleModel

LAYOUT_SIZES = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
)
"""What a checkpoint records of the layout it was saved at."""


def start_rank(config: TrainConfig) -> RLTrainer | None:
    """This rank's trainer, ready to `fit`; None on an engine rank, once it has served the
    trainers until they finished. A config error is a `ConfigError`."""
    apart = join_placement(config)
    if apart is not None and apart.is_engine:
        serve_engine_rank(config, apart)
        return None
    return build_trainer(config, apart)


def check_output_dir(config: TrainConfig) -> None:
    t = config.trainer
    leftovers = previous_run_files(t.output_dir)
    if leftovers and not (t.resume or t.overwrite):
        shown = ", ".join(str(p) for p in leftovers[:3]) + (" ..." * (len(leftovers) > 3))
        raise ConfigError(
            f"trainer.output_dir {t.output_dir} holds an earlier run ({shown}) "
            "and trainer.resume is false: set trainer.overwrite=true to replace it, "
            "trainer.resume=true to continue it, or choose another output_dir"
        )


def build_roles(config: TrainConfig, arch) -> Roles:
    c = config
    model = RoleModel(
        arch=arch,
        layout=c.parallel,
        model_path=c.model.path,
        precision=c.model.precision,
        recompute=c.model.recompute,
        moe=c.model.moe,
        use_remove_padding=c.model.use_remove_padding,
        use_fused_kernels=c.model.use_fused_kernels,
    )
    actor = Actor(
        replace(model, lora=c.actor.lora),
        optim=scheduled_optim(c, "actor"),
        temperature=c.rollout.temperature,
        router_replay=c.actor.router_replay,
        logits_checkpointing=c.actor.logits_checkpointing,
    )
    reference = None
    if c.use_reference and c.actor.lora.enabled:  # the base, adapters off: no second copy
        reference = AdapterOffReference(actor)
    elif c.use_reference:  # forward only: nothing to recompute
        reference = ReferencePolicy(
            replace(model, recompute=None), temperature=c.rollout.temperature
        )
    critic = None
    if c.use_critic:
        critic_path = c.model.critic_path or c.model.path
        critic_arch = ModelSource(critic_path).architecture()
        critic = Critic(
            replace(model, arch=critic_arch, model_path=critic_path, lora=c.critic.lora),
            optim=scheduled_optim(c, "critic"),
        )
    teacher = None
    if c.use_teacher:  # forward only, its own architecture, weights and maybe layout
        teacher = build_teacher(c, model)
    return Roles(actor, reference, critic, teacher)


def build_teacher(c: TrainConfig, student: RoleModel):
    """The distillation teacher: a `ReferencePolicy` of its checkpoint, on the job's layout
    or on one of its own (`teacher.tensor_model_parallel_size`, `workers/own_layout.py`)."""
    teacher = replace(
        student,
        arch=ModelSource(c.teacher.path).architecture(),
        layout=c.teacher.layout(c.parallel),
        model_path=c.teacher.path,
        recompute=None,
    )

    def build() -> ReferencePolicy:
        return ReferencePolicy(teacher, temperature=c.rollout.temperature)

    if teacher.layout == student.layout:
        return build()
    world = torch.distributed.get_world_size()
    return OnOwnLayout(build, LayoutGroups.build(teacher.layout, world, teacher.arch))


def truncated_sampling_warning(config: TrainConfig) -> str | None:
    r = config.rollout
    if not r.truncated or config.algorithm.rollout_correction.rollout_is is not None:
        return None
    return (
        f"warning: rollout.top_p={r.top_p} / top_k={r.top_k} sample from a truncated "
        "distribution while the trainer's policy is the full tempered one: an "
        "off-policy gap (logged as logprob_gap_*, rollout_corr/*) that "
        "algorithm.rollout_correction.rollout_is would reweight"
    )


def build_trainer(config: TrainConfig, apart: EnginesApart | None) -> RLTrainer:
    """This trainer rank's run (the module docstring's order); `apart`: the engines are
    other ranks."""
    # transformers is heavy: loaded once a run is being built, not at import
    from transformers import AutoTokenizer

    c, t = config, config.trainer
    world_size = apart.placement.world_size if apart else int(os.environ.get("WORLD_SIZE", 1))
    validate_config(c, world_size)  # before any process group or model
    check_output_dir(c)
    source = ModelSource(c.model.path)
    arch = source.architecture()
    ctx = distributed.initialize(c.parallel, arch=arch, seed=t.seed, deterministic=t.deterministic)
    watchdog = Watchdog(
        timeout_s=t.step_timeout_s, rank=ctx.rank, world_size=ctx.world_size, store=default_store()
    )
    tokenizer = AutoTokenizer.from_pretrained(source.hf_dir)
    prompts = PromptStream(load_prompts(c.data, tokenizer, prompt_tools(c)), seed=t.seed)
    rollout_builder = RolloutBuilder(c, ctx, tokenizer, apart)
    if t.overwrite and ctx.rank == 0:  # only once the run's inputs proved usable
        clear_previous_run(t.output_dir)
    torch.distributed.barrier()
    roles = build_roles(c, arch)
    warning = truncated_sampling_warning(c)
    if warning and ctx.rank == 0:
        print(warning, flush=True)
    # A colocated engine sizes its KV cache from the device memory free now: what the config
    # offloads leaves first (a push, a resume or a save reads the chunks: they come back).
    roles.offload_for_rollout(c)
    memory = MemoryTimeline(
        Path(t.output_dir) / MEMORY_TIMELINE if ctx.rank == 0 else None,
        lambda: rollout.memory_state(),  # the service, made next
    )
    rollout = rollout_builder.build(memory.release_cached_blocks)
    if source.is_megatron:
        rollout.push_weights(roles.actor, 0)
    checkpoints = CheckpointManager(
        output_dir=t.output_dir,
        rank=ctx.rank,
        world_size=ctx.world_size,
        keep_last=t.keep_last,
        layout={k: getattr(c.parallel, k) for k in LAYOUT_SIZES},
    )
    logger = MetricsLogger(
        output_dir=t.output_dir,
        total_steps=t.total_steps,
        enabled=ctx.rank == 0,
        settings=LoggerConfig(
            loggers=t.logger,
            project=t.project_name,
            run_name=t.experiment_name,
            config=to_dict(c),
            step_offset=c.critic.pretrain_steps if c.use_critic else 0,
        ),
    )
    STOP.install()  # again: `megatron_rl.cli.train` installs it first thing
    # a request one rank sees reaches all (engine ranks too: the job's store)
    STOP.share_through(apart.store if apart else default_store(), ctx.rank)
    warning = plain_torchrun_warning()
    if warning and ctx.rank == 0:
        print(warning, flush=True)
    trainer = RLTrainer(
        RunParts(c, ctx, watchdog, tokenizer, prompts, roles, rollout, checkpoints, logger, memory)
    )
    if t.resume:
        trainer.resume_from_newest()
    roles.offload_for_rollout(c)  # the first rollout runs as every later one
    return trainer
