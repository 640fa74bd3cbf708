"""The run's sections (`model`, `rollout`, `actor`, `critic`, `rewards`, `trainer`): typed,
frozen dataclasses, a docstring under each field, each checking its own values in
`__post_init__`. The sections other packages own (`parallel`, `data`, `algorithm`,
`model.precision`, ...) are theirs, imported here; checks that need more than one section, or
the disk, are `validate.py`'s; reading YAML is `loader.py`'s.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from megatron_rl.config.loader import items_parsed_by
from megatron_rl.envs.config import EnvConfig
from megatron_rl.models.gpt import MoEConfig, PrecisionConfig, RecomputeConfig
from megatron_rl.models.lora import LoRAConfig
from megatron_rl.models.router_replay import RouterReplayConfig
from megatron_rl.parallel.distributed import ParallelLayout
from megatron_rl.rewards.config import RewardFnConfig, reward_fn_config
from megatron_rl.rewards.pool import ScoringPoolConfig
from megatron_rl.rollout.rating import RatingConfig
from megatron_rl.rollout.tool_formats import TRUNCATE_SIDES, tool_format
from megatron_rl.workers.losses_config import PolicyLossConfig, ValueLossConfig
from megatron_rl.workers.optimizer import OptimConfig

ROLLOUT_ENGINES = ("vllm", "hf")
PLACEMENTS = ("colocated", "disaggregated")
LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
"""The `trainer.logger` names (`trainer/loggers.py` builds them); console and jsonl are
`MetricsLogger`'s own."""


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
    moe: MoEConfig = field(default_factory=MoEConfig)
    """How a mixture-of-experts policy routes and dispatches (megatron-core's `moe_*` names);
    the experts themselves come from the checkpoint's config."""
    use_remove_padding: bool = False
    """Pack each micro-batch of the actor, reference and critic: its rows back to back with
    no padding, each attending only within itself (verl's name; `data/packing.py`). With
    use_dynamic_bsz the token budget then counts packed tokens. Same losses as unpadded;
    dense models only."""
    use_fused_kernels: bool = False
    """The policy's log-prob head (actor, reference, teacher) takes each tile's forward sums
    (log-sum-exp, entropy, the label's logit, the kept probabilities) in one compiled kernel
    (`torch.compile`: Triton on CUDA, the C++ compiler on the CPU; verl's name for its fused
    log-prob and entropy head) instead of eager passes; the same results. The head's
    backward is compiled on CUDA either way. Off by default until a GPU measures it faster
    (`bench/gpu.md`); each process compiles it once, in seconds."""


@dataclass(frozen=True)
class MultiTurnConfig:
    """Multi-turn rollouts with tools (verl's `rollout.multi_turn`, docs/tools.md): the
    policy generates until a tool call, `env` answers, the answer's tokens are appended, and
    the policy goes on; the trainer learns from exactly the ids the engine sampled, the
    answers in the sequence and out of the loss."""

    enable: bool = False
    max_turns: int = 2
    """Policy turns per trajectory (verl's `max_assistant_turns`)."""
    max_response_length: int = 256
    """Tokens after the prompt, policy turns and answers together (verl's
    `response_length`); each turn draws at most rollout.max_new_tokens of them."""
    format: str = "hermes"
    """How calls are written and answers appended (`rollout/tool_formats.py`): "hermes"
    (Qwen2.5 / Qwen3's `<tool_call>` JSON), "llama3_python_tag" (Llama-3.1's built-in
    interpreter), "code" (raw code in `<tool_call>`, ReTool / ToRL style)."""
    max_tool_response_length: int = 256
    """Characters of an answer kept (verl's name)."""
    tool_response_truncate_side: str = "middle"
    """Which part of a longer answer is kept: "left" (its start), "right", "middle" (both
    ends; verl's name)."""
    env: EnvConfig = field(default_factory=EnvConfig)

    def __post_init__(self) -> None:
        check_at_least(self, max_turns=1, max_response_length=1, max_tool_response_length=1)
        tool_format(self.format)  # refuses unknown formats and those not built, by name
        if self.tool_response_truncate_side not in TRUNCATE_SIDES:
            raise ValueError(
                f"tool_response_truncate_side must be one of {TRUNCATE_SIDES}, got "
                f"{self.tool_response_truncate_side!r}"
            )


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
    """vLLM's TP: ranks per rollout engine. Colocated, None is
    parallel.tensor_model_parallel_size, and an engine's ranks must lie in one model replica,
    so it divides TP (or TP x PP when DP = 1); a replica's engines split its prompts
    (`rollout/replica.py`). Disaggregated, None is 1 and it divides engine_ranks."""
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.5
    cpu_kv_cache_space_gib: int = 1
    rating: RatingConfig = field(default_factory=RatingConfig)
    placement: str = "colocated"
    """Where the engines run (docs/design/async.md): "colocated", every rank trains and
    generates in turn (the engine sleeps while Megatron trains); "disaggregated", the last
    `engine_ranks` ranks of the launch only generate and the others only train, the actor's
    weights pushed to them after every update (`sync/weight_push.py`)."""
    engine_ranks: int = 0
    """With placement=disaggregated: how many ranks (the last of the world) run the rollout
    engines, vllm_tensor_parallel_size ranks each; 0 with placement=colocated."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)

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
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.placement == "colocated" and self.engine_ranks:
            raise ValueError(
                f"engine_ranks={self.engine_ranks} needs placement=disaggregated (colocated "
                "engines run on every rank)"
            )
        if self.placement == "disaggregated" and self.engine_ranks < 1:
            raise ValueError(
                f"placement=disaggregated needs engine_ranks >= 1 (the ranks that only "
                f"generate), got {self.engine_ranks}"
            )
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

    @property
    def max_response_tokens(self) -> int:
        """The longest response: max_new_tokens, or a multi-turn trajectory's length."""
        if self.multi_turn.enable:
            return self.multi_turn.max_response_length
        return self.max_new_tokens


@dataclass(frozen=True)
class AsyncConfig:
    """Generation ahead of training (docs/design/async.md; YAML section `async`): the
    engine ranks of a disaggregated placement generate the next step's rollout while the
    trainers train on this one."""

    max_staleness: int = 0
    """k: every sample a PPO step trains on was started by a policy at most k updates older
    than the one it updates (AReaL's max_head_offpolicyness, NeMo-RL's
    max_trajectory_age_steps). 0: synchronous, exactly the colocated run; 1: one-step-off
    (Noukhovitch et al. 2024, arXiv 2410.18252; verl's one_step_off_policy): step s's
    rollout is generated with the weights after step s - 2 while step s - 1 trains. 2 and
    more need partial_rollout: without it a push would wait for the engines to finish every
    round they may run ahead, rounds no update needs yet."""
    partial_rollout: bool = False
    """AReaL's interruptible generation (Fu et al. 2025, arXiv 2505.24298; verl's fully async
    `partial_rollout`): new weights reach an engine while it generates (within a few engine
    steps); the responses in flight continue under them, re-prefilled, each token keeping
    the log-prob and version of the policy that sampled it (`Sample.segments`;
    `rollout/mixed_version_share`). Staleness counts from a response's first token. Needs
    the vLLM engine (rollout.name=vllm): the HF engine cannot be interrupted. Samples then
    depend on when the weights arrive: runs are not reproducible."""

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.max_staleness >= 2 and not self.partial_rollout:
            raise ValueError(
                f"max_staleness={self.max_staleness} needs partial_rollout=true: without it a "
                "push waits for every round the engines may run ahead, rounds no update needs"
            )


@dataclass(frozen=True)
class RoleConfig:
    """What the actor and the critic both have: an optimizer, micro-batches by count or by
    token budget, and what each keeps off the device between its uses. The YAML keys are the
    role's own (`actor.grad_offload`, `critic.grad_offload`)."""

    optim: OptimConfig = field(default_factory=OptimConfig)
    use_dynamic_bsz: bool = False
    """Micro-batches by token budget instead of micro_batch_size (verl's name): rows grouped
    longest first, each micro-batch padded only to its own longest row, so a long-tailed
    length distribution costs its tokens, not rows x the longest response. Exact: the
    loss is normalised over the mini-batch, however it is split. (The critic without it
    splits like the actor's micro_batch_size.)"""
    ppo_max_token_len_per_gpu: int = 16384
    """With use_dynamic_bsz: padded tokens (rows x length) per training micro-batch on one
    model replica. At least max_prompt_length + max_new_tokens."""
    grad_offload: bool = False
    """Free the gradient buffers between updates (rollout, experience, sync): memory for vLLM."""
    optimizer_offload: bool = False
    """Keep the optimizer's state and master weights in host memory between updates (needs
    bf16/fp16 params: with fp32 ones megatron's optimizer steps the model's own weights)."""
    param_offload: bool = False
    """Keep the parameters in host memory between the role's uses. Actor (verl's
    param_offload): from the weight sync until the next experience, so the rollout engine
    generates without them on the device. Critic: from the end of its update until the next
    experience (its values), through the weight sync and the rollout. Bit-exact (bytes copied
    back); costs two host<->device copies of the weights a step."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA: train low-rank adapters on the role's linears, every other weight frozen
    (`lora.rank` > 0; `models/lora.py`). The actor's reference is then its base with the
    adapters off; the critic's value head still trains in full."""

    forward_budget_key: ClassVar[str] = ""
    """The role's field with the token budget of its forward-only passes (None: the
    training budget); named per role, so the YAML keys stay verl's."""

    def __post_init__(self) -> None:
        check_at_least(self, ppo_max_token_len_per_gpu=1)
        if self.forward_budget() is not None:
            check_at_least(self, **{self.forward_budget_key: 1})

    def token_budget(self, forward: bool = False) -> int | None:
        """Padded tokens per micro-batch of a training (or `forward`-only) pass; None without
        use_dynamic_bsz (micro_batch_size decides)."""
        if not self.use_dynamic_bsz:
            return None
        return (forward and self.forward_budget()) or self.ppo_max_token_len_per_gpu

    def forward_budget(self) -> int | None:
        """The role's forward-only budget as set (None: unset, or a role without one)."""
        return getattr(self, self.forward_budget_key) if self.forward_budget_key else None


@dataclass(frozen=True)
class ActorConfig(RoleConfig):
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6))
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    ppo_mini_batch_size: int = 32
    """Samples per optimizer step, over all DP ranks (VAPO: 512)."""
    micro_batch_size: int = 4
    """Samples per forward/backward on one rank (without use_dynamic_bsz)."""
    log_prob_max_token_len_per_gpu: int | None = None
    """With use_dynamic_bsz: the budget of the forward-only passes (old and reference
    log-probs), which keep no activations for a backward; None: ppo_max_token_len_per_gpu."""
    ppo_epochs: int = 1
    ref_param_offload: bool = False
    """The reference policy's parameters (with a KL term) in host memory from the end of
    the experience until the next one: neither training nor generation holds them."""
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)
    """Mixtures of experts: rollout routing replay (R3) or its mismatch measure (verl's
    `actor.router_replay`; `models/router_replay.py`)."""
    logits_checkpointing: bool = False
    """Recompute the head's logits in backward, a tile at a time, keeping nothing
    [tokens, vocabulary]-sized from forward (the leanest head; named like verl's
    `entropy_checkpointing`). False: forward keeps each tile's probabilities in the weight's
    dtype (V/TP x 2 bytes a token in bf16, half the fp32 logits a plain step keeps) and
    backward skips one of the head's three GEMMs (`parallel/vocab.py`). The memory planner
    prices either."""

    forward_budget_key: ClassVar[str] = "log_prob_max_token_len_per_gpu"

    def __post_init__(self) -> None:
        check_at_least(self, ppo_mini_batch_size=1, micro_batch_size=1, ppo_epochs=1)
        super().__post_init__()


@dataclass(frozen=True)
class CriticConfig(RoleConfig):
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=2e-6))
    enable: bool | None = None
    """None: on for an estimator registered with needs_critic (GAE: PPO/VAPO), off for the
    critic-free ones."""
    loss: ValueLossConfig = field(default_factory=ValueLossConfig)
    pretrain_steps: int = 0
    """Value pretraining steps before PPO (VAPO: 50), policy frozen, lambda = 1 returns."""
    pretrain_ev_threshold: float | None = None
    """Stop value pretraining early once explained variance reaches this."""
    pretrain_ev_warn_below: float = 0.3
    """Warn when value pretraining ends below this explained variance (the mean of its last 5
    steps, `settled_explained_variance`): the critic then explains little of the returns,
    and GAE advantages (lambda < 1) lean on its noise."""
    forward_max_token_len_per_gpu: int | None = None
    """The budget of the critic's forward-only values pass; None: ppo_max_token_len_per_gpu."""

    forward_budget_key: ClassVar[str] = "forward_max_token_len_per_gpu"


@dataclass(frozen=True)
class TeacherConfig:
    """On-policy distillation (Agarwal et al. 2024, GKD; Thinking Machines 2025): a frozen
    teacher scores every token the student samples, and each policy token's advantage gains
    -kl_coef x (log pi_student - log pi_teacher), the per-token reverse KL (slime's
    `--opd-kl-coef`, added to any estimator's advantages; `algorithm.estimator:
    on_policy_distill` for the teacher's signal alone, the published recipe)."""

    path: str | None = None
    """The teacher: a Hugging Face directory or a megatron_rl checkpoint, as `model.path`; any
    supported architecture, larger than the student allowed, with the student's tokenizer
    and chat template. None: no teacher."""
    kl_coef: float = 1.0
    """Weight of the per-token reverse KL in the advantages."""
    param_offload: bool = False
    """The teacher's parameters in host memory from the end of the experience until the
    next one, as `actor.ref_param_offload` does for the reference."""
    evaluate: bool = False
    """At every evaluation, evaluate the teacher too, with the student's request seeds (the
    same draws: a paired comparison): its weights go into the rollout engine for it, then
    the actor's come back. Every eval set's metrics as `eval/teacher/...`
    (`eval/teacher/accuracy` beside `eval/accuracy`). Needs eval sets, a colocated rollout,
    the student's architecture (the engine is built for it) and the job's layout."""
    tensor_model_parallel_size: int | None = None
    """The teacher's TP within the job's world (NeMo-RL's teacher `megatron_cfg`); None:
    the job's (`parallel`). A layout of its own has Megatron groups of its own
    (`workers/own_layout.py`); its data-parallel size is the world over its TP x PP."""
    pipeline_model_parallel_size: int | None = None
    """The teacher's PP within the job's world; None: the job's."""

    def __post_init__(self) -> None:
        if self.kl_coef <= 0:
            raise ValueError(
                f"kl_coef must be > 0 (leave path unset for no teacher), got {self.kl_coef}"
            )
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            size = getattr(self, key)
            if size is not None and (not isinstance(size, int) or size < 1):
                raise ValueError(f"{key} must be a positive integer or unset, got {size!r}")

    def layout(self, job: ParallelLayout) -> ParallelLayout:
        """The teacher's layout: the job's `parallel`, or the sizes set here with neither a
        virtual pipeline nor expert parallelism (a dense teacher's forward needs neither)."""
        tp = self.tensor_model_parallel_size or job.tensor_model_parallel_size
        pp = self.pipeline_model_parallel_size or job.pipeline_model_parallel_size
        if (tp, pp) == (job.tensor_model_parallel_size, job.pipeline_model_parallel_size):
            return job
        return dataclasses.replace(
            job,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=None,
            sequence_parallel=job.sequence_parallel and tp > 1,
            expert_model_parallel_size=1,
            expert_tensor_parallel_size=None,
        )


@dataclass(frozen=True)
class RewardsConfig:
    reward_fns: tuple[RewardFnConfig, ...] = field(
        default=(),
        metadata=items_parsed_by(reward_fn_config, what="reward functions", tag="type"),
    )
    """Each entry's `type` chooses its class (`rewards/config.py`, REWARD_TYPES)."""
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
    stop_grace_s: float | None = None
    """The seconds the scheduler leaves between its stop signal and its SIGKILL (SLURM: the
    lead time of `--signal=B:USR1@N`; Kubernetes: terminationGracePeriodSeconds; plain
    torchrun: its shutdown timeout). A stop request mid-step waits for the phase in flight,
    then saves (docs/reliability.md): every save that takes more than half of it is warned
    about, and the abort line says when a stop used more than all of it. None: not known."""
    rewindable_update: bool = True
    """Copy each trained role's weights, optimizer state and schedule to host memory before
    the step's first optimizer update when the step has several (`workers/rewind.py`), so a
    stop request between mini-batches rewinds them and saves the step's start within one
    mini-batch. Costs host memory of the weights and the optimizer shard per role and GPU,
    and a device-to-host copy of them per step. False: such a request waits for the update
    to end."""
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
        if self.stop_grace_s is not None and not self.stop_grace_s > 0:
            raise ValueError(f"stop_grace_s must be > 0 (or null), got {self.stop_grace_s}")
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
    (`rollout/evaluation.py`), a sample being correct when its reward is > 0."""

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
