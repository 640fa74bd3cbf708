"""The run's configuration: typed dataclasses, read from YAML, overridden by `key=value`.

    torchrun ... -m megatron_rl.cli.train --config examples/tiny/vapo.yaml trainer.total_steps=3 \\
        actor.optim.lr=1e-5 data.path=/data/math.jsonl

Every key is checked against the dataclasses: an unknown key is an error that names it and
suggests the closest known one; a value of the wrong type names the key and the expected
type. `validate_config` checks the numbers that must agree (layout vs model, batch sizes vs
micro-batches x DP) before any process group or model exists.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from megatron_rl.algorithms.advantages import ADV_ESTIMATORS, AdvantageConfig
from megatron_rl.data.prompts import PromptDataConfig
from megatron_rl.models.gpt import PrecisionConfig, RecomputeConfig
from megatron_rl.parallel.distributed import ParallelLayout
from megatron_rl.rewards.config import RewardFnConfig, reward_fn_config
from megatron_rl.rewards.pool import ScoringPoolConfig
from megatron_rl.rollout.rating import RatingConfig
from megatron_rl.rollout.replica import RolloutLayout
from megatron_rl.trainer.loggers import LOGGERS
from megatron_rl.workers.losses_config import PolicyLossConfig, ValueLossConfig
from megatron_rl.workers.optimizer import OptimConfig, resolve_lr_decay_steps

GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")
ROLLOUT_ENGINES = ("vllm", "hf")


def check_at_least(section, **minimum_and_value) -> None:
    """Refuse a field below its minimum, naming it: `check_at_least(self, keep_last=1)`."""
    for name, low in minimum_and_value.items():
        value = getattr(section, name)
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")


@dataclass(frozen=True)
class ModelConfig:
    path: str = ""
    """The policy: actor, reference and the vLLM engine start from it. A Hugging Face
    directory, or a megatron_rl checkpoint (`checkpoints_convert.hf_to_megatron` output, or a
    training checkpoint's `step_N/actor`), loaded at any layout without converting again."""
    critic_path: str | None = None
    """What the critic starts from: the policy (None), a reward model whose `score` head
    becomes the value head (VAPO initialises the critic from the RM), or a critic checkpoint;
    HF or Megatron as `path`."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    """Activation recompute of the actor and critic (megatron's recompute_granularity)."""


@dataclass(frozen=True)
class RolloutConfig:
    name: str = "vllm"
    """The rollout engine (verl's `rollout.name`): "vllm", or "hf", a Hugging Face model with
    its own decode loop (`rollout/hf_engine.py`) for debugging and small GPU checks without
    vLLM installed: slow, one whole model per rank (vllm_tensor_parallel_size 1), no KV-cache
    budget (gpu_memory_utilization, cpu_kv_cache_space_gib are vLLM's and refused)."""
    rollout_batch_size: int = 8
    """Prompts per step, over all DP ranks (VAPO: 512)."""
    n_samples_per_prompt: int = 4
    """Group sampling (VAPO: 16)."""
    max_new_tokens: int = 64
    temperature: float = 1.0
    """Sampling temperature (> 0). The actor, the reference and the entropy use the same
    softmax(logits / T) the samples were drawn from."""
    top_p: float = 1.0
    top_k: int = 0
    """Truncated sampling (top_p < 1, top_k >= 1) samples from a distribution the trainer does
    not model (it uses the full tempered vocabulary, as verl and OpenRLHF do): RL recipes keep
    both off; if on, `algorithm.rollout_correction` reweights by the engine's log-probs."""
    dtype: str | None = None
    """The rollout engine's dtype (vLLM's `dtype`); None: the policy's
    `model.precision.params_dtype`. A lower precision than the trainer's leaves a log-prob gap
    (`logprob_gap_*`, `rollout_corr/*`) that `algorithm.rollout_correction` can correct."""
    vllm_tensor_parallel_size: int | None = None
    """vLLM's TP: ranks per rollout engine; None: parallel.tensor_model_parallel_size. An
    engine's ranks must lie in one model replica, so it divides TP (or TP x PP when DP = 1);
    a replica's engines split its prompts (`rollout/replica.py`)."""
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.5
    cpu_kv_cache_space_gib: int = 1
    rating: RatingConfig = field(default_factory=RatingConfig)

    def __post_init__(self) -> None:
        check_at_least(self, rollout_batch_size=1, n_samples_per_prompt=1, max_new_tokens=1)
        if not self.temperature > 0:
            raise ValueError(
                f"temperature must be > 0 for RL rollouts (0 is greedy: no distribution to "
                f"train on), got {self.temperature}"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (off) or >= 1, got {self.top_k}")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be one of float32, bfloat16, float16, got {self.dtype!r}")
        if self.name not in ROLLOUT_ENGINES:
            raise ValueError(f"name must be one of {ROLLOUT_ENGINES}, got {self.name!r}")
        if self.name == "hf":
            for key in ("gpu_memory_utilization", "cpu_kv_cache_space_gib"):
                default = RolloutConfig.__dataclass_fields__[key].default
                if getattr(self, key) != default:
                    raise ValueError(
                        f"{key}={getattr(self, key)} sizes vLLM's KV cache: the hf engine "
                        f"(name=hf) has none; leave it at {default} or use name=vllm"
                    )

    @property
    def truncated(self) -> bool:
        return self.top_p < 1 or self.top_k > 0


@dataclass(frozen=True)
class ActorConfig:
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6))
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    ppo_mini_batch_size: int = 32
    """Samples per optimizer step, over all DP ranks (VAPO: 512)."""
    micro_batch_size: int = 4
    """Samples per forward/backward on one rank (without use_dynamic_bsz)."""
    use_dynamic_bsz: bool = False
    """Micro-batches by token budget instead of micro_batch_size (verl's name): rows grouped
    longest first, each micro-batch padded only to its own longest row, so a long-tailed
    length distribution costs its tokens, not rows x the longest response. Exact: the
    loss is normalised over the mini-batch, however it is split."""
    ppo_max_token_len_per_gpu: int = 16384
    """With use_dynamic_bsz: padded tokens (rows x length) per training micro-batch on one
    model replica. At least max_prompt_length + max_new_tokens."""
    log_prob_max_token_len_per_gpu: int | None = None
    """With use_dynamic_bsz: the budget of the forward-only passes (old and reference
    log-probs), which keep no activations for a backward; None: ppo_max_token_len_per_gpu."""
    ppo_epochs: int = 1
    grad_offload: bool = False
    """Free the gradient buffers between updates (rollout, experience, sync): memory for vLLM."""
    optimizer_offload: bool = False
    """Keep the optimizer's state and master weights in host memory between updates (needs
    bf16/fp16 params: with fp32 ones megatron's optimizer steps the model's own weights)."""
    param_offload: bool = False
    """Keep the parameters in host memory from the weight sync until the next experience
    (verl's param_offload): the rollout engine generates without them on the device.
    Bit-exact (bytes copied back); costs two host<->device copies of the weights a step."""
    ref_param_offload: bool = False
    """The reference policy's parameters (with a KL term) in host memory from the end of
    the experience until the next one: neither training nor generation holds them."""

    def __post_init__(self) -> None:
        check_at_least(
            self,
            ppo_mini_batch_size=1,
            micro_batch_size=1,
            ppo_epochs=1,
            ppo_max_token_len_per_gpu=1,
        )
        if self.log_prob_max_token_len_per_gpu is not None:
            check_at_least(self, log_prob_max_token_len_per_gpu=1)

    def token_budget(self, forward: bool = False) -> int | None:
        """Padded tokens per micro-batch of a training (or `forward`-only) pass; None without
        use_dynamic_bsz (micro_batch_size decides)."""
        if not self.use_dynamic_bsz:
            return None
        return (forward and self.log_prob_max_token_len_per_gpu) or self.ppo_max_token_len_per_gpu


@dataclass(frozen=True)
class CriticConfig:
    enable: bool | None = None
    """None: on for the GAE estimator (PPO/VAPO), off for the critic-free ones."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=2e-6))
    loss: ValueLossConfig = field(default_factory=ValueLossConfig)
    pretrain_steps: int = 0
    """Value pretraining steps before PPO (VAPO: 50), policy frozen, lambda = 1 returns."""
    pretrain_ev_threshold: float | None = None
    """Stop value pretraining early once explained variance reaches this."""
    pretrain_ev_warn_below: float = 0.3
    """Warn when value pretraining ends below this explained variance (the mean of its last 5
    steps, `settled_explained_variance`): the critic then explains little of the returns,
    and GAE advantages (lambda < 1) lean on its noise."""
    use_dynamic_bsz: bool = False
    """As actor.use_dynamic_bsz, for the critic's update and values (without it the
    critic splits like the actor's micro_batch_size)."""
    ppo_max_token_len_per_gpu: int = 16384
    """As actor.ppo_max_token_len_per_gpu."""
    forward_max_token_len_per_gpu: int | None = None
    """The budget of the critic's forward-only values pass; None: ppo_max_token_len_per_gpu."""
    grad_offload: bool = False
    """As actor.grad_offload, for the critic."""
    optimizer_offload: bool = False
    """As actor.optimizer_offload, for the critic."""
    param_offload: bool = False
    """The critic's parameters in host memory from the end of its update until the next
    experience (its values): through the weight sync and the rollout."""

    def __post_init__(self) -> None:
        check_at_least(self, ppo_max_token_len_per_gpu=1)
        if self.forward_max_token_len_per_gpu is not None:
            check_at_least(self, forward_max_token_len_per_gpu=1)

    def token_budget(self, forward: bool = False) -> int | None:
        """As ActorConfig.token_budget."""
        if not self.use_dynamic_bsz:
            return None
        return (forward and self.forward_max_token_len_per_gpu) or self.ppo_max_token_len_per_gpu


@dataclass(frozen=True)
class RewardsConfig:
    reward_fns: tuple[RewardFnConfig, ...] = ()
    pool: ScoringPoolConfig = field(default_factory=ScoringPoolConfig)


@dataclass(frozen=True)
class TrainerConfig:
    total_steps: int = 10
    seed: int = 0
    deterministic: bool = False
    """torch.use_deterministic_algorithms (warn-only): deterministic kernels where torch has
    them. On for the tiny CPU recipes; on GPU it costs speed."""
    output_dir: str = "runs/train"
    save_interval: int = 10
    """Save every N steps (0: only at the end and on SIGTERM/SIGUSR1). Not 0 by default: a
    job killed without a signal it can act on (a node failure, SIGKILL) loses at most N steps."""
    keep_last: int = 2
    """Checkpoints kept (>= 1); the one `latest` names is never removed."""
    save_hf_interval: int = 0
    """Also write the actor as a Hugging Face model (transformers / vLLM / the Hub) every N
    steps and at the end, to output_dir/hf/step_N (0: never; export any checkpoint later with
    checkpoints_convert.megatron_to_hf). These are not pruned."""
    resume: bool = True
    """Continue from the newest complete checkpoint in output_dir, if any (a corrupt one is
    named and the previous complete one is used)."""
    overwrite: bool = False
    """With resume: false, clear the checkpoints and metrics an earlier run left in
    output_dir; without it such an output_dir is refused (nothing is ever mixed)."""
    balance_batch: bool | None = None
    """Re-deal the experience's rows over the data-parallel ranks so their token counts are
    even before the update (verl's name; `parallel.collectives.balance_over_data_parallel`).
    None: on with actor.use_dynamic_bsz, where a rank's micro-batches cost its tokens."""
    max_nonfinite_in_a_row: int = 3
    """Updates with NaN/Inf loss or gradients are skipped; this many in a row stop the run."""
    step_timeout_s: float | None = 7200.0
    """The watchdog (`trainer/watchdog.py`): a step (with its evaluation and save) running
    longer ends the run with where each rank is, the phase, and the ranks that did not
    arrive at a collective others wait in. None: off. Set it well above the slowest step."""
    logger: tuple[str, ...] = ("console", "jsonl")
    """Where step metrics go, any of console, jsonl, tensorboard, wandb, mlflow (verl's
    name; `trainer/loggers.py`). output_dir/metrics.jsonl is written whatever the list."""
    project_name: str = "megatron_rl"
    """The W&B project / MLflow experiment."""
    experiment_name: str = ""
    """The W&B / MLflow run name; default: the output_dir's last part."""
    eval_sets: tuple[EvalSetConfig, ...] = ()
    """Held-out sets, each evaluated before training, every eval_interval steps and at the
    end: n samples per prompt at its temperature, avg@n and pass@k (`EvalSetConfig`), also
    in output_dir/eval.jsonl. The first set's avg@n and mean reward are also logged as
    eval/accuracy and eval/reward_mean, the run's headline numbers."""
    eval_data_path: str | None = None
    """Shorthand for one greedy set: `eval_sets: [{path: P, n: 1, temperature: 0}]`."""
    eval_interval: int = 0

    def __post_init__(self) -> None:
        check_at_least(
            self, total_steps=0, save_interval=0, keep_last=1, save_hf_interval=0,
            eval_interval=0, max_nonfinite_in_a_row=1,
        )  # fmt: skip
        if self.step_timeout_s is not None and not self.step_timeout_s > 0:
            raise ValueError(
                f"step_timeout_s must be > 0 (or null: off), got {self.step_timeout_s}"
            )
        if self.overwrite and self.resume:
            raise ValueError("overwrite: true replaces an earlier run, so it needs resume: false")
        unknown = [name for name in self.logger if name not in LOGGERS]
        if unknown:
            raise ValueError(f"logger: {unknown} unknown; choose from {list(LOGGERS)}")
        if not self.experiment_name:
            object.__setattr__(self, "experiment_name", Path(self.output_dir).name)
        if self.eval_data_path:
            if self.eval_sets:
                raise ValueError("eval_data_path is a shorthand for eval_sets: give one of them")
            object.__setattr__(self, "eval_sets", (EvalSetConfig(path=self.eval_data_path),))
            object.__setattr__(self, "eval_data_path", None)  # resolved: said once, as a set
        names = [s.name for s in self.eval_sets]
        if len(set(names)) != len(names):
            raise ValueError(f"eval_sets: names must differ (they name the metrics), got {names}")


@dataclass(frozen=True)
class EvalSetConfig:
    """One held-out prompt set evaluated during training (verl: `data.val_files` with
    `rollout.val_kwargs`). Same fields as `data`; metrics `eval/{name}/avg@{n}`,
    `eval/{name}/pass@{k}`, `eval/{name}/reward_mean`, `eval/{name}/response_length/mean`
    (`trainer/evaluation.py`), a sample being correct when its reward is > 0."""

    path: str
    name: str = ""
    """In the metric names; default: the file's stem."""
    n: int = 1
    """Samples per prompt (the VAPO paper's AIME24 avg@32: n 32 at temperature 1.0)."""
    temperature: float = 0.0
    """0: greedy (then n must be 1: every sample would be the same)."""
    top_p: float = 1.0
    pass_k: tuple[int, ...] = ()
    """pass@k reported for each k (1 <= k <= n); default: 1 and n."""
    max_new_tokens: int | None = None
    """Default: rollout.max_new_tokens."""

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("eval set: path is required")
        if not self.name:
            object.__setattr__(self, "name", Path(self.path).stem)
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name):
            raise ValueError(f"eval set name {self.name!r}: use letters, digits, _ . - only")
        check_at_least(self, n=1, temperature=0.0)
        if self.temperature == 0 and self.n > 1:
            raise ValueError(
                f"eval set {self.name}: n={self.n} at temperature 0 samples the same greedy "
                "response n times; use n: 1, or a temperature > 0"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"eval set {self.name}: top_p must be in (0, 1], got {self.top_p}")
        if not self.pass_k:
            object.__setattr__(self, "pass_k", tuple(sorted({1, self.n})))
        bad = [k for k in self.pass_k if not 1 <= k <= self.n]
        if bad:
            raise ValueError(f"eval set {self.name}: pass_k {bad} outside 1..n={self.n}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"eval set {self.name}: max_new_tokens must be >= 1")


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelLayout = field(default_factory=ParallelLayout)
    data: PromptDataConfig = field(default_factory=lambda: PromptDataConfig(path=""))
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algorithm: AdvantageConfig = field(default_factory=AdvantageConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    @property
    def use_critic(self) -> bool:
        if self.critic.enable is None:
            return self.algorithm.estimator == "gae"
        return self.critic.enable

    @property
    def use_reference(self) -> bool:
        """beta = 0 skips the reference model entirely (no forward, no weights)."""
        return self.algorithm.kl_coef > 0 or self.actor.loss.kl_loss_coef > 0


# ------------------------------------------------------------------ dict/YAML -> dataclasses


class ConfigError(ValueError):
    pass


def _unwrap_optional(tp):
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _coerce(value: Any, tp, key: str):
    tp, optional = _unwrap_optional(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"config key {key}: null is not allowed here")
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key)
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"config key {key}: {value!r} is not one of {typing.get_args(tp)}")
        return value
    if origin is tuple or tp is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key {key}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]: each element an X
            return tuple(_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
        return tuple(value)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key {key}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is torch.dtype:
        dtype = getattr(torch, str(value), None)
        if not isinstance(dtype, torch.dtype):
            raise ConfigError(
                f"config key {key}: expected a torch dtype name (float32, bfloat16), got {value!r}"
            )
        return dtype
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key {key}: expected true or false, got {value!r}")
    if tp in (int, float):
        try:
            number = tp(value) if not isinstance(value, bool) else None
        except (TypeError, ValueError):
            number = None
        if number is None or (tp is int and isinstance(value, float) and value != int(value)):
            raise ConfigError(f"config key {key}: expected {tp.__name__}, got {value!r}")
        return number
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"config key {key}: expected a string, got {value!r}")
        return str(value)
    return value


def from_dict(cls, data: Any, prefix: str = ""):
    """Build dataclass `cls` from nested dicts; unknown keys are errors with a suggestion."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ConfigError(f"config key {prefix or '<root>'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        if name not in fields:
            close = difflib.get_close_matches(name, fields, n=1)
            hint = (
                f" (did you mean {(prefix + '.' if prefix else '') + close[0]!r}?)" if close else ""
            )
            raise ConfigError(f"unknown config key {key!r}{hint}; known here: {sorted(fields)}")
        if cls is RewardsConfig and name == "reward_fns":
            if not isinstance(value, list):
                raise ConfigError(f"config key {key}: expected a list of reward functions")
            try:
                kwargs[name] = tuple(
                    reward_fn_config(v, f"{key}[{i}]") for i, v in enumerate(value)
                )
            except ValueError as e:
                raise ConfigError(str(e)) from None
            continue
        kwargs[name] = _coerce(value, hints[name], key)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config section {prefix or '<root>'}: {e}") from e


def to_dict(config) -> dict:
    """The resolved configuration as plain data (saved next to checkpoints and metrics)."""
    if dataclasses.is_dataclass(config):
        out = {f.name: to_dict(getattr(config, f.name)) for f in dataclasses.fields(config)}
        kind = getattr(type(config), "type", None)
        if isinstance(config, RewardFnConfig) and kind:
            out = {"type": kind, **out}
        return out
    if isinstance(config, torch.dtype):
        return str(config).removeprefix("torch.")
    if isinstance(config, (list, tuple)):
        return [to_dict(v) for v in config]
    if isinstance(config, dict):
        return {k: to_dict(v) for k, v in config.items()}
    return config


def apply_override(data: dict, assignment: str) -> None:
    """`a.b.c=value` (value parsed as YAML) into nested dict `data`, in place."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {assignment!r}: expected key=value")
    value = yaml.safe_load(raw) if raw else ""
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {assignment!r}: {part!r} is not a section")
    node[parts[-1]] = value


def load_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    data: dict = {}
    if path is not None:
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except FileNotFoundError as e:
            raise ConfigError(f"config file {path}: not found") from e
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path}: not valid YAML: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path}: expected a mapping at the top level")
    for assignment in overrides:
        apply_override(data, assignment)
    try:
        return from_dict(TrainConfig, data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}" if path else str(e)) from None


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


def validate_config(config: TrainConfig, world_size: int) -> None:
    """Everything that can be checked before a process group or a model exists."""
    from megatron_rl.models.source import ModelSource

    if not config.model.path:
        raise ConfigError(
            "config key model.path: the policy (a Hugging Face directory or a megatron_rl "
            "checkpoint) is required"
        )
    if not config.data.path:
        raise ConfigError("config key data.path: the prompt dataset is required")
    # Every input the run reads, named here in one line, not by a traceback from every rank
    # once the process group is up.
    inputs = [("data.path", config.data.path)]
    inputs += [
        (f"trainer.eval_sets[{i}].path", s.path) for i, s in enumerate(config.trainer.eval_sets)
    ]
    if config.use_critic and config.model.critic_path:
        inputs.append(("model.critic_path", config.model.critic_path))
    for key, path in inputs:
        if not Path(path).exists():
            raise ConfigError(f"config key {key}: {path}: no such file or directory")
    if not config.rewards.reward_fns:
        raise ConfigError("config key rewards.reward_fns: at least one reward function is needed")
    if config.algorithm.estimator not in ADV_ESTIMATORS:
        close = difflib.get_close_matches(config.algorithm.estimator, ADV_ESTIMATORS, n=1)
        raise ConfigError(
            f"config key algorithm.estimator: unknown {config.algorithm.estimator!r}"
            + (f" (did you mean {close[0]!r}?)" if close else "")
            + f"; registered: {sorted(ADV_ESTIMATORS)}"
        )
    arch = ModelSource(config.model.path).architecture()
    try:
        config.parallel.validate(world_size, arch)
    except ValueError as e:
        raise ConfigError(f"config section parallel: {e}") from None
    dp = config.parallel.data_parallel_size(world_size)
    r, a = config.rollout, config.actor
    if r.name == "hf" and (r.vllm_tensor_parallel_size or 1) > 1:
        raise ConfigError(
            f"rollout.vllm_tensor_parallel_size={r.vllm_tensor_parallel_size} with "
            "rollout.name=hf: the hf engine holds the whole model on each rank (TP 1); "
            "leave vllm_tensor_parallel_size unset or 1, or use rollout.name=vllm"
        )
    try:
        rollout_layout(config, world_size).check()
    except ValueError as e:
        raise ConfigError(str(e)) from None
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
    if r.rating.strategy != "plain" and config.algorithm.estimator in GROUP_ESTIMATORS:
        if r.rating.strategy == "balance":
            raise ConfigError(
                f"rollout.rating.strategy=balance drops samples from groups; the group "
                f"estimator {config.algorithm.estimator!r} needs whole groups"
            )
    if config.algorithm.estimator in GROUP_ESTIMATORS and r.n_samples_per_prompt < 2:
        raise ConfigError(
            f"algorithm.estimator={config.algorithm.estimator!r} needs "
            f"rollout.n_samples_per_prompt >= 2, got {r.n_samples_per_prompt}"
        )
    for key, asked, present, how in (
        ("critic.param_offload", config.critic.param_offload, config.use_critic,
         "critic.enable or algorithm.estimator gae"),
        ("actor.ref_param_offload", config.actor.ref_param_offload, config.use_reference,
         "algorithm.kl_coef or actor.loss.kl_loss_coef > 0"),
    ):  # fmt: skip
        if asked and not present:
            raise ConfigError(f"{key}=true but this run has no such model (it needs {how})")
    if config.model.precision.params_dtype == torch.float32:
        for role in ("actor", "critic"):
            if getattr(config, role).optimizer_offload:
                raise ConfigError(
                    f"{role}.optimizer_offload needs model.precision.params_dtype bfloat16 or "
                    "float16: with float32 parameters megatron's optimizer steps the model's "
                    "own weights, which would leave the device with it"
                )
    longest = config.data.max_prompt_length + r.max_new_tokens
    for role, forward_key in (("actor", "log_prob"), ("critic", "forward")):
        role_cfg = getattr(config, role)
        for forward in (False, True):
            budget = role_cfg.token_budget(forward)
            if budget is not None and budget < longest:
                key = (
                    f"{forward_key}_max_token_len_per_gpu"
                    if forward
                    else "ppo_max_token_len_per_gpu"
                )
                raise ConfigError(
                    f"{role}.{key}={budget} (with use_dynamic_bsz) is below the longest "
                    f"sequence, data.max_prompt_length + rollout.max_new_tokens = {longest}: "
                    "one sequence must fit a micro-batch"
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
