"""Two roles in one launch (`rollout.placement: disaggregated`; docs/design/async.md
§3.2): the first ranks of the torchrun world train (Megatron: actor, critic, reference), the
last `engine_ranks` only generate (vLLM). Global rank 0 is a trainer, so logging and
checkpoints stay where they are.

Why each role gets a default process group of its own: Megatron's `initialize_model_parallel`
and vLLM's external launcher both take the default group (and RANK / WORLD_SIZE) as their
world. `initialize_role` therefore joins the job's key-value store (torchrun's TCPStore, the
one its env:// rendezvous uses), makes the role's default group on a prefix of it and
rewrites RANK / WORLD_SIZE to the role's, after which `distributed.initialize` and the engines
run unchanged on their sub-world. Groups across the roles (the weight push's bridge,
`sync/weight_push.py`) are built on the same store.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rl.cpu_math import warm_up_vector_math

TRAINER, ENGINE = "trainer", "engine"


@dataclass(frozen=True)
class Placement:
    """The split of a world of `world_size` ranks: the last `engine_ranks` generate."""

    world_size: int
    engine_ranks: int

    def __post_init__(self) -> None:
        if not 0 < self.engine_ranks < self.world_size:
            raise ValueError(
                f"rollout.engine_ranks={self.engine_ranks}: a disaggregated placement needs "
                f"at least one engine rank and one training rank in the world of "
                f"{self.world_size} (nproc_per_node x nodes)"
            )

    @property
    def trainer_ranks(self) -> int:
        return self.world_size - self.engine_ranks

    def role(self, rank: int) -> str:
        return TRAINER if rank < self.trainer_ranks else ENGINE

    def role_rank(self, rank: int) -> int:
        """`rank`'s rank within its role's world."""
        return rank if rank < self.trainer_ranks else rank - self.trainer_ranks

    def role_size(self, role: str) -> int:
        return self.trainer_ranks if role == TRAINER else self.engine_ranks

    def bridge_rank(self, rank: int) -> int | None:
        """`rank`'s rank in the weight push's bridge (trainer rank 0, the source, then every
        engine rank), or None: the other trainers are not in it."""
        if rank == 0:
            return 0
        return None if rank < self.trainer_ranks else 1 + rank - self.trainer_ranks

    @property
    def bridge_size(self) -> int:
        return 1 + self.engine_ranks


def job_store(timeout: datetime.timedelta) -> dist.Store:
    """A client of the job's key-value store at MASTER_ADDR:MASTER_PORT, in the namespace of
    this start of the workers, as torch's env:// rendezvous makes it: torchrun's agent hosts
    the store (TORCHELASTIC_USE_AGENT_STORE); without torchrun, rank 0 does."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    rank = int(os.environ.get("RANK", "0"))
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ.get("WORLD_SIZE", "1")),
        is_master=not agent and rank == 0,
        timeout=timeout,
        wait_for_workers=False,
    )
    # a restarted worker group must not read the keys of the attempt before it
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"megatron_rl/attempt_{attempt}/", store)


def initialize_role(placement: Placement, timeout_minutes: float = 30.0) -> tuple[str, dist.Store]:
    """Make this process's role's default group (gloo on CPU, NCCL on GPU) and set RANK /
    WORLD_SIZE to its rank and size in that role; returns (role, the job's store). Call it
    before `distributed.initialize` (trainers) or the engine (engine ranks)."""
    warm_up_vector_math()  # an engine rank never calls `distributed.initialize`: see `cpu_math`
    rank = int(os.environ["RANK"])
    if int(os.environ["WORLD_SIZE"]) != placement.world_size:
        raise ValueError(
            f"placement for a world of {placement.world_size}, but WORLD_SIZE="
            f"{os.environ['WORLD_SIZE']}"
        )
    if dist.is_initialized():
        raise RuntimeError("initialize_role: a default process group exists already")
    timeout = datetime.timedelta(minutes=timeout_minutes)
    store = job_store(timeout)
    role = placement.role(rank)
    role_rank, role_size = placement.role_rank(rank), placement.role_size(role)
    if torch.cuda.is_available():  # before the NCCL group: its ranks' devices, not all GPU 0
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        "nccl" if torch.cuda.is_available() else "gloo",
        store=dist.PrefixStore(f"role_{role}/", store),
        rank=role_rank,
        world_size=role_size,
        timeout=timeout,
    )
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(role_rank), str(role_size)
    return role, store
