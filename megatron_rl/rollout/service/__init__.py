"""The rollout side of a run, one interface whatever the placement (`RolloutService`): what
the trainer holds (`service.py`), how it is made (`builder.py`), one step's rollout as either
placement makes it (`rounds.py`), and the disaggregated placement's engine ranks
(`engine_worker.py`) with the wire protocol between them and the trainers (`protocol.py`).
The trainer imports this package's names only, never its modules."""

from megatron_rl.rollout.progress import RolloutProgress, save_progress
from megatron_rl.rollout.service.builder import (
    EnginesApart,
    RolloutBuilder,
    join_placement,
    serve_engine_rank,
)
from megatron_rl.rollout.service.rounds import STAGES, prompt_tools
from megatron_rl.rollout.service.service import Rollout, RolloutService

__all__ = [
    "STAGES",
    "EnginesApart",
    "Rollout",
    "RolloutBuilder",
    "RolloutProgress",
    "RolloutService",
    "join_placement",
    "prompt_tools",
    "save_progress",
    "serve_engine_rank",
]
