"""The run's configuration, in three layers, each importing only those below it:

- `loader.py`: a dataclass from nested dicts / YAML with `key=value` overrides, and back
  (`from_dict`, `to_dict`, `apply_override`, `load`). Generic: it names no section and imports
  nothing from megatron_rl (where it can sit: its docstring).
- `sections.py`: the run's own sections (model, rollout, actor and critic on a shared
  `RoleConfig`, rewards, trainer, eval sets), each checking its own values.
- `run.py` and `validate.py`: the run's config (`TrainConfig`, `load_config`) and the checks
  across sections and against the disk (`validate_config`, `rollout_layout`,
  `scheduled_optim`), done before any process group or model exists.
"""

from megatron_rl.config.loader import (
    ConfigError,
    apply_override,
    from_dict,
    items_parsed_by,
    load,
    read_yaml,
    to_dict,
)
from megatron_rl.config.run import TrainConfig, load_config
from megatron_rl.config.sections import (
    LOGGERS,
    ROLLOUT_ENGINES,
    ActorConfig,
    CriticConfig,
    EvalSetConfig,
    ModelConfig,
    RewardsConfig,
    RoleConfig,
    RolloutConfig,
    TeacherConfig,
    TrainerConfig,
    check_at_least,
)
from megatron_rl.config.validate import (
    check_inputs,
    rollout_layout,
    scheduled_optim,
    validate_config,
)

__all__ = [
    "LOGGERS",
    "ROLLOUT_ENGINES",
    "ActorConfig",
    "ConfigError",
    "CriticConfig",
    "EvalSetConfig",
    "ModelConfig",
    "RewardsConfig",
    "RoleConfig",
    "RolloutConfig",
    "TeacherConfig",
    "TrainConfig",
    "TrainerConfig",
    "apply_override",
    "check_at_least",
    "check_inputs",
    "from_dict",
    "items_parsed_by",
    "load",
    "load_config",
    "read_yaml",
    "rollout_layout",
    "scheduled_optim",
    "to_dict",
    "validate_config",
]
