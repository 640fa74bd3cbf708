"""Helpers shared by the converters: the megatron checkpoint's layout on disk, atomic output
directories, and running a command as its own torchrun workers."""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from megatron_rl import fsutil
from megatron_rl.models import dist_checkpoint
from megatron_rl.models.architecture import ModelArchitecture
from megatron_rl.models.dist_checkpoint import (  # noqa: F401  (the converters' names)
    HF_META_SUBDIR,
    METADATA,
    MODEL_SUBDIR,
    copy_side_files,
)


class ConversionError(Exception):
    """Bad input: the message names the file/tensor and what was expected."""


def fail(message) -> None:
    """Exit with one line. Accepts an exception (a KeyError's message is its first arg)."""
    if isinstance(message, KeyError) and message.args:
        message = message.args[0]
    raise SystemExit(f"error: {message}")


def add_layout_args(p: argparse.ArgumentParser) -> None:
    """--tp, --pp, and for mixtures of experts --ep / --etp."""
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models)")
    p.add_argument("--etp", type=int, help="expert-tensor-parallel size (MoE; default --tp)")


def describe(args) -> str:
    """The layout as the commands print it: TP2PP1, TP1PP1EP2ETP1."""
    experts = f"EP{args.ep}ETP{args.etp or args.tp}" if args.ep > 1 or args.etp else ""
    return f"TP{args.tp}PP{args.pp}{experts}"


def checked_layout(args, arch: ModelArchitecture):
    """The layout these commands run with (--tp, --pp, --ep, --etp; a MoE model split over
    TP runs with sequence parallelism, as megatron-core requires), and its world size: the
    least that both the dense (TP x PP) and the expert (ETP x EP x PP) grids divide. A layout
    that cannot split the model exits with one line naming the numbers."""
    from megatron_rl.parallel.distributed import ParallelLayout

    try:
        layout = ParallelLayout(
            tensor_model_parallel_size=args.tp,
            pipeline_model_parallel_size=args.pp,
            sequence_parallel=arch.is_moe and args.tp > 1,
            expert_model_parallel_size=args.ep,
            expert_tensor_parallel_size=args.etp,
        )
        world = math.lcm(args.tp * args.pp, layout.expert_tensor_size * args.ep * args.pp)
        layout.validate(world, arch)
    except ValueError as e:
        fail(e)
    return layout, world


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def read_metadata(ckpt_dir: Path) -> tuple[dict, ModelArchitecture]:
    try:
        return dist_checkpoint.read_metadata(ckpt_dir)
    except FileNotFoundError as e:
        fail(e)


def atomic_output_dir(out: Path, overwrite: bool = False):
    """`megatron_rl.fsutil.atomic_output_dir`, with an existing output as a one-line error."""
    try:
        fsutil.check_output_dir(Path(out), overwrite)
    except FileExistsError as e:
        fail(str(e))
    return fsutil.atomic_output_dir(out, overwrite=True)


def launch_self(module: str, argv: list[str], nproc: int, extra: list[str]) -> None:
    """Re-run this command as `nproc` torchrun workers; a worker failure is one clear line
    plus the failing rank's traceback."""
    from megatron_rl.launch import TorchrunError, run_torchrun

    try:
        result = run_torchrun(module, [*argv, *extra], nproc=nproc, timeout=24 * 3600)
    except TorchrunError as e:
        fail(f"{module} workers failed:\n{e}")
    sys.stdout.write("".join(ln + "\n" for ln in result.output.splitlines() if ln.startswith("[")))


def load_megatron_checkpoint(ckpt_dir: Path, layout):
    """Build this rank's chunks for the checkpoint's role and load them at `layout` (any
    TP/PP: megatron's sharded tensors reshard on load); a LoRA checkpoint's adapters merged
    into its base. Needs distributed.initialize first."""
    from megatron_rl.models.critic import build_critic_chunks
    from megatron_rl.models.gpt import build_gpt_model_chunks
    from megatron_rl.models.source import ModelSource

    meta, arch = read_metadata(ckpt_dir)
    critic = meta["role"] == "critic"
    build = build_critic_chunks if critic else build_gpt_model_chunks
    chunks = build(arch, layout, use_transformer_engine=False)
    source = ModelSource(ckpt_dir)
    if source.lora:  # adapters alone: its base, the adapters merged in
        (source.load_critic if critic else source.load_policy)(chunks, arch)
    else:
        dist_checkpoint.load_role(chunks, None, ckpt_dir)
    return chunks, arch, meta
