"""Typed configs of the reward functions, one class per `type`, built into callables.

In YAML a run lists its reward functions; the final reward of a sample is the weighted sum:

    reward_fns:
      - {type: math, correct_reward: 1.0, incorrect_reward: -1.0}
      - {type: reward_model, model_dir: /ckpt/llama-rm, weight: 0.5}
      - {type: remote, url: "http://rm-host:8000/score"}
      - {type: python, path: "my_pkg.rewards:compute_score", kwargs: {strict: true}}
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

from megatron_rl.rewards.base import RewardFunction
from megatron_rl.rewards.functions import MathReward, PythonReward
from megatron_rl.rewards.math_reward import MathVerifierConfig
from megatron_rl.rewards.megatron_rm import MegatronRewardModel
from megatron_rl.rewards.remote import RemoteReward
from megatron_rl.rewards.reward_model import HFRewardModel


@dataclass(frozen=True)
class RewardFnConfig:
    name: str = ""
    """Defaults to the type; names the function in metrics and errors."""
    weight: float = 1.0
    failure_reward: float = 0.0
    """Used in place of a score that failed (raised, timed out, NaN/inf)."""
    timeout_s: float | None = 10.0
    """Per call: one sample for per-sample functions, one batch for batched ones. For `math`
    and `python` functions it is enforced by running them in a worker process that is killed
    when a call outlives it (None: in the trainer's process, without a limit)."""
    type: ClassVar[str] = ""
    killable: ClassVar[bool] = False
    """Runs in a killable worker process when timeout_s is set."""

    @property
    def display_name(self) -> str:
        return self.name or self.type

    @property
    def collective(self) -> bool:
        """True for a function every rank of a model-parallel group must call together (a
        reward model sharded by Megatron); others are called on one rank of the group."""
        return False

    def build(self) -> RewardFunction:
        raise NotImplementedError


@dataclass(frozen=True)
class MathRewardConfig(RewardFnConfig):
    correct_reward: float = 1.0
    incorrect_reward: float = -1.0
    unparseable_reward: float = -1.0
    fallback_last_number: bool = True
    backend: str = "math_verify"
    """"math_verify": symbolic equivalence (Hugging Face's math-verify), the default;
    "fast": exact numbers and normalised strings, for integer-answer data (AIME,
    DAPO-Math-17k) and for arithmetic, where math_verify would credit a copied, unevaluated
    `3 + 4` for 7. See `rewards/math_reward.py` for what `fast` judges wrong."""
    timeout_s: float | None = 1.0
    type: ClassVar[str] = "math"
    killable: ClassVar[bool] = True

    def __post_init__(self) -> None:
        self.verifier()  # refuses an unknown backend by name, at config time

    def verifier(self):
        return MathVerifierConfig(
            self.correct_reward,
            self.incorrect_reward,
            self.unparseable_reward,
            self.fallback_last_number,
            backend=self.backend,
        )

    def build(self) -> RewardFunction:
        return MathReward(self.display_name, self.verifier(), self.timeout_s)


@dataclass(frozen=True)
class PythonRewardConfig(RewardFnConfig):
    path: str = ""
    """`package.module:function`."""
    batched: bool = False
    kwargs: dict = field(default_factory=dict)
    type: ClassVar[str] = "python"
    killable: ClassVar[bool] = True

    def build(self) -> RewardFunction:
        if not self.path:
            raise ValueError("reward_fns: type 'python' needs path: 'package.module:function'")
        return PythonReward(self.display_name, self.path, self.batched, self.kwargs, self.timeout_s)


@dataclass(frozen=True)
class RewardModelConfig(RewardFnConfig):
    model_dir: str = ""
    """A Hugging Face sequence-classification checkpoint with its own tokenizer/template."""
    backend: str = "hf"
    """"hf": transformers, on one device, also in Ray workers. "megatron": sharded with the
    trainer's TP/PP inside the torchrun world (inline scoring only)."""
    batch_size: int = 8
    max_length: int = 4096
    dtype: str = "float32"
    timeout_s: float | None = None
    type: ClassVar[str] = "reward_model"

    def __post_init__(self) -> None:
        if self.backend not in ("hf", "megatron"):
            raise ValueError(f"reward_model backend {self.backend!r}: expected 'hf' or 'megatron'")

    @property
    def collective(self) -> bool:
        return self.backend == "megatron"

    def build(self) -> RewardFunction:
        if not self.model_dir:
            raise ValueError("reward_fns: type 'reward_model' needs model_dir")
        cls = MegatronRewardModel if self.backend == "megatron" else HFRewardModel
        return cls(
            self.display_name,
            self.model_dir,
            self.batch_size,
            self.max_length,
            self.dtype,
            self.timeout_s,
        )


@dataclass(frozen=True)
class RemoteRewardConfig(RewardFnConfig):
    url: str = ""
    batch_size: int = 32
    max_retries: int = 3
    backoff_s: float = 0.5
    timeout_s: float | None = 30.0
    """Per HTTP attempt."""
    type: ClassVar[str] = "remote"

    def build(self) -> RewardFunction:
        if not self.url:
            raise ValueError("reward_fns: type 'remote' needs url")
        return RemoteReward(
            self.display_name,
            self.url,
            self.batch_size,
            self.timeout_s or 30.0,
            self.max_retries,
            self.backoff_s,
        )


REWARD_TYPES: dict[str, type[RewardFnConfig]] = {
    c.type: c for c in (MathRewardConfig, PythonRewardConfig, RewardModelConfig, RemoteRewardConfig)
}


def reward_fn_config(entry: dict, where: str = "reward_fns") -> RewardFnConfig:
    """One YAML/dict entry -> its typed config; unknown types and keys are refused by name."""
    if not isinstance(entry, dict) or "type" not in entry:
        raise ValueError(f"{where}: each entry needs a 'type' (one of {sorted(REWARD_TYPES)})")
    entry = dict(entry)
    kind = entry.pop("type")
    if kind not in REWARD_TYPES:
        raise ValueError(f"{where}: unknown type {kind!r}; expected one of {sorted(REWARD_TYPES)}")
    cls = REWARD_TYPES[kind]
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(entry) - known)
    if unknown:
        raise ValueError(
            f"{where}: type {kind!r} has no option(s) {unknown}; known: {sorted(known)}"
        )
    return cls(**entry)
