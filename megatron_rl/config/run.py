"""The run's configuration: every section in one typed, frozen dataclass, read from YAML and
overridden by `key=value`.

    torchrun ... -m megatron_rl.cli.train --config examples/tiny/vapo.yaml trainer.total_steps=3 \\
        actor.optim.lr=1e-5 data.path=/data/math.jsonl

Every key is checked against the dataclasses (`loader.py`): an unknown key is an error that
names it and suggests the closest known one; a value of the wrong type names the key and the
expected type. `validate.validate_config` checks what needs more than one section or the disk
before any process group or model exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from megatron_rl.algorithms.advantages import AdvantageConfig, estimator_traits
from megatron_rl.config.loader import load
from megatron_rl.config.sections import (
    ActorConfig,
    AsyncConfig,
    CriticConfig,
    ModelConfig,
    RewardsConfig,
    RolloutConfig,
    TeacherConfig,
    TrainerConfig,
)
from megatron_rl.data.prompts import PromptDataConfig
from megatron_rl.parallel.distributed import ParallelLayout


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelLayout = field(default_factory=ParallelLayout)
    data: PromptDataConfig = field(default_factory=lambda: PromptDataConfig(path=""))
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    algorithm: AdvantageConfig = field(default_factory=AdvantageConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    async_: AsyncConfig = field(default_factory=AsyncConfig, metadata={"key": "async"})

    @property
    def use_critic(self) -> bool:
        """critic.enable, or by default whether the estimator needs one (GAE)."""
        if self.critic.enable is None:
            return estimator_traits(self.algorithm.estimator).needs_critic
        return self.critic.enable

    @property
    def use_reference(self) -> bool:
        """beta = 0 skips the reference model entirely (no forward, no weights)."""
        return self.algorithm.kl_coef > 0 or self.actor.loss.kl_loss_coef > 0

    @property
    def use_teacher(self) -> bool:
        """A teacher scores the student's tokens (on-policy distillation)."""
        return self.teacher.path is not None


def load_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    """The run's config from the YAML file at `path` (None: defaults) and `key=value`
    overrides; a ConfigError names the file and the key."""
    return load(TrainConfig, path, overrides)
