"""One entry to bring up a process: torch.distributed, Megatron's parallel state, the RNG.

`initialize(layout)` is what every distributed entry point calls first. It
1. validates the parallel layout against the world size and the model (before any process
   group exists, so a bad layout costs nothing and names the numbers),
2. applies the CPU compatibility layer when CUDA is absent (`megatron_rl.parallel.cpu_compat`)
   and, where megatron-core has no fused multi-tensor kernels, torch's foreach ones (the
   gradient norm kept on the device: `megatron_rl.parallel.multi_tensor`),
3. initialises torch.distributed (NCCL on GPU, gloo on CPU) from torchrun's environment,
4. builds Megatron's TP/PP/DP groups (`parallel_state.initialize_model_parallel`),
5. seeds torch and Megatron's model-parallel RNG tracker.

Context parallelism stays at 1 for now; the layout carries the field so callers do not
change when it arrives. Expert parallelism (mixture-of-experts models) splits each MoE layer's
experts over `expert_model_parallel_size` ranks; megatron-core lays the expert groups over
the same world as tp(=ETP)-ep-dp-pp (docs/layouts.md).
"""

from __future__ import annotations

import datetime
import os
import random
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from megatron_rl.cpu_math import warm_up_vector_math
from megatron_rl.parallel import cpu_compat, multi_tensor
from megatron_rl.procutil import THREAD_ENV_VARS, free_port


class ShardableModel(Protocol):
    """What a layout checks of a model (`models.architecture.ModelArchitecture` is one): a
    protocol, so the parallel layer needs nothing from the models above it."""

    is_moe: bool

    def check_divisible(self, tp: int, layer_chunks: int, etp: int = 1, ep: int = 1) -> None: ...


@dataclass(frozen=True)
class ParallelLayout:
    """How the world is split (Megatron naming, as in verl/NeMo-RL configs)."""

    tensor_model_parallel_size: int = 1
    """TP: ranks that shard each weight matrix (attention heads, MLP columns, vocabulary)."""
    pipeline_model_parallel_size: int = 1
    """PP: ranks that each hold a contiguous slice of the layers."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per PP rank for the interleaved 1F1B schedule (None = plain 1F1B)."""
    sequence_parallel: bool = False
    """Shard activations outside attention/MLP along the sequence across the TP group."""
    context_parallel_size: int = 1
    """CP: reserved; must be 1 in this version."""
    expert_model_parallel_size: int = 1
    """EP: ranks that each hold a slice of every MoE layer's experts (tokens travel to them)."""
    expert_tensor_parallel_size: int | None = None
    """ETP: ranks that shard each expert's matrices; None = tensor_model_parallel_size
    (megatron-core's default). ETP 1 with EP > 1 is what verl, NeMo-RL and slime run."""
    distributed_timeout_minutes: float = 30.0
    """How long any collective may wait for its peers before it fails on its rank (every
    process group's timeout; Megatron-LM's name). A collective waits for the slowest rank's
    work before it (an uneven rollout), so keep it above that wait; `trainer.step_timeout_s`
    is the watchdog that names where each rank is."""

    @property
    def model_parallel_size(self) -> int:
        return (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
        )

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // self.model_parallel_size

    @property
    def expert_tensor_size(self) -> int:
        """ETP as megatron-core resolves it (None -> TP)."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    def validate(self, world_size: int, arch: ShardableModel | None = None) -> None:
        """Raise ValueError, naming the numbers, if this layout cannot run.

        Checked before any process group is created.
        """
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        vpp, cp = self.virtual_pipeline_model_parallel_size, self.context_parallel_size
        ep, etp = self.expert_model_parallel_size, self.expert_tensor_size
        for name, value in (
            ("tensor_model_parallel_size", tp),
            ("pipeline_model_parallel_size", pp),
            ("context_parallel_size", cp),
            ("expert_model_parallel_size", ep),
            ("expert_tensor_parallel_size", etp),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if cp != 1:
            raise ValueError(f"context_parallel_size={cp} is not supported yet; use 1")
        if world_size % (tp * pp * cp) != 0:
            raise ValueError(
                f"world size {world_size} is not divisible by "
                f"tensor_model_parallel_size * pipeline_model_parallel_size = {tp} * {pp} = {tp * pp}"
            )
        if vpp is not None:
            if pp < 2:
                raise ValueError(
                    f"virtual_pipeline_model_parallel_size={vpp} needs "
                    f"pipeline_model_parallel_size >= 2, got {pp}"
                )
            if vpp < 1:
                raise ValueError(f"virtual_pipeline_model_parallel_size must be >= 1, got {vpp}")
        if not self.distributed_timeout_minutes > 0:
            raise ValueError(
                f"distributed_timeout_minutes must be > 0, got {self.distributed_timeout_minutes}"
            )
        if self.sequence_parallel and tp < 2:
            raise ValueError(
                f"sequence_parallel=True needs tensor_model_parallel_size >= 2, got {tp}"
            )
        if arch is not None and not arch.is_moe and (ep > 1 or self.expert_tensor_parallel_size):
            raise ValueError(
                "expert_model_parallel_size / expert_tensor_parallel_size are set but the "
                "model is dense (no experts)"
            )
        if world_size % (etp * ep * pp) != 0:
            raise ValueError(
                f"world size {world_size} is not divisible by expert_tensor_parallel_size * "
                f"expert_model_parallel_size * pipeline_model_parallel_size = "
                f"{etp} * {ep} * {pp} = {etp * ep * pp}"
            )
        if arch is None:
            return
        if arch.is_moe and tp > 1 and not self.sequence_parallel:
            raise ValueError(
                f"tensor_model_parallel_size={tp} with a mixture-of-experts model needs "
                "sequence_parallel=True (megatron-core's MoE layer refuses to train without it)"
            )
        arch.check_divisible(tp, pp * (vpp or 1), etp, ep)


@dataclass(frozen=True)
class DistributedContext:
    """What a rank knows about itself after `initialize`."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    layout: ParallelLayout
    tp_rank: int
    pp_rank: int
    dp_rank: int
    dp_size: int
    cpu_compat: bool

    @property
    def is_first_pp_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_pp_stage(self) -> bool:
        return self.pp_rank == self.layout.pipeline_model_parallel_size - 1


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError as e:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from e


def initialize(
    layout: ParallelLayout,
    *,
    arch: ShardableModel | None = None,
    seed: int = 1234,
    deterministic: bool = False,
) -> DistributedContext:
    """Initialise torch.distributed, Megatron parallel state and the RNG for this rank.

    Reads RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT as set by torchrun; a
    single process without them runs as world size 1. Seeds Python's, NumPy's and torch's
    generators. `deterministic` makes torch pick deterministic kernels where it has them
    (warning, not failing, where it has none); what it cannot fix across machines is
    the CPU's own rounding (AVX2 vs AVX-512 kernels) and the thread count (`pin_threads`).
    """
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    layout.validate(world_size, arch)

    warm_up_vector_math()  # before any parallel exp or log: see `cpu_math`
    compat = cpu_compat.apply()
    cpu_compat.define_missing_te_names()
    multi_tensor.use_foreach_kernels()
    use_cuda = torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            # a lone process (a warm start, a tool) takes a free port: two at once on one
            # host met on a fixed one (EADDRINUSE)
            os.environ["MASTER_PORT"] = str(free_port() if world_size == 1 else 29500)
        torch.distributed.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(minutes=layout.distributed_timeout_minutes),
        )

    # why: megatron-core takes seconds to import; a layout error above is reported first
    from megatron.core import parallel_state, tensor_parallel

    initialize_model_parallel(layout)

    seed_everything(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    if use_cuda:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        # No CUDA generators to fork: the inference tracker's forks are no-ops, which is
        # exact for dropout 0 (the RL default).
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)

    return DistributedContext(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        device=device,
        backend=backend,
        layout=layout,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        cpu_compat=compat,
    )


def initialize_model_parallel(layout: ParallelLayout) -> None:
    """Megatron's groups for `layout` in `parallel_state` (collective over the world)."""
    from megatron.core import parallel_state  # why: as in `initialize`, megatron loads late

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tensor_model_parallel_size,
        pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=layout.virtual_pipeline_model_parallel_size,
        context_parallel_size=layout.context_parallel_size,
        expert_model_parallel_size=layout.expert_model_parallel_size,
        expert_tensor_parallel_size=layout.expert_tensor_parallel_size,
        distributed_timeout_minutes=layout.distributed_timeout_minutes,
        # On CPU the default group already is gloo; duplicates would only cost sockets.
        create_gloo_process_groups=torch.cuda.is_available(),
    )


def device() -> torch.device:
    """The device of this rank's models and collectives: its CUDA device (set by
    `initialize`, NCCL groups), else the CPU (gloo). Metadata that crosses ranks (counts,
    flags, shapes) is made here too, so one NCCL group carries it: no CPU side group."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def seed_everything(seed: int) -> None:
    """Python's `random`, NumPy's global generator and torch's (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def pin_threads(threads: int) -> dict[str, str]:
    """Run this process's intra-op work on `threads` threads, and return the environment
    that makes child processes (torchrun workers, vLLM) do the same. A CPU reduction's
    result depends on how it is split over threads, so a fixed count is one less thing that
    differs between machines."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    env = {name: str(threads) for name in THREAD_ENV_VARS}
    os.environ.update(env)
    return env


def destroy() -> None:
    """Tear down Megatron's groups and the default process group (safe to call twice)."""
    from megatron.core import parallel_state  # why: as in `initialize`, megatron loads late

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
