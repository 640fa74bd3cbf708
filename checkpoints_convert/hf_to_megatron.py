"""Hugging Face -> megatron-core distributed checkpoint (loadable at any TP/PP, and EP/ETP).

    python -m checkpoints_convert.hf_to_megatron --hf-dir D --out-dir O --tp 2 --pp 2
        [--ep E --etp T] [--role actor|critic] [--lora-dir L] [--overwrite]

--role critic takes a sequence-classification reward model (`score.weight` [1, hidden]) and
writes the critic: the transformer plus that head as the value head.

Memory: each of the TP*PP workers builds only its shard of the model and reads HF tensors
one at a time (a fused QKV or gate/up needs its two or three full HF tensors at once), so the
peak per worker is its shard plus about one layer's largest tensors. For Qwen2.5-32B in bf16
at TP8PP4 that is ~2 GB of shard plus ~0.6 GB (gate + up: 2 x 27648 x 5120 x 2 bytes).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from checkpoints_convert.common import (
    HF_META_SUBDIR,
    add_layout_args,
    atomic_output_dir,
    checked_layout,
    copy_side_files,
    describe,
    fail,
    launch_self,
    under_torchrun,
)
from megatron_rl.models.architecture import ModelArchitecture
from megatron_rl.models.dist_checkpoint import save_role, write_metadata
from megatron_rl.models.hf_config import read_hf_config
from megatron_rl.models.hf_mapping import HFCheckpointReader, validate_hf_checkpoint
from megatron_rl.procutil import exit_now


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hf-dir", type=Path, required=True)
    p.add_argument("--out-dir", type=Path, required=True)
    add_layout_args(p)
    p.add_argument("--role", choices=["actor", "critic"], default="actor")
    p.add_argument("--lora-dir", type=Path)
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--work-dir", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def open_reader(args):
    reader = HFCheckpointReader(args.hf_dir)
    if args.lora_dir is not None:
        from checkpoints_convert.lora import LoraMergedReader

        reader = LoraMergedReader(reader, args.lora_dir)
    return reader


def check_inputs(args) -> ModelArchitecture:
    """Everything that can be wrong with the inputs, found before any process starts."""
    try:
        arch = read_hf_config(args.hf_dir)
    except (ValueError, FileNotFoundError) as e:
        fail(e)
    checked_layout(args, arch)
    try:
        validate_hf_checkpoint(open_reader(args), arch, args.role)
    except (ValueError, KeyError, FileNotFoundError) as e:
        fail(e)
    return arch


def worker(args) -> None:
    import torch

    from megatron_rl.models.critic import build_critic_chunks, load_value_head
    from megatron_rl.models.gpt import build_gpt_model_chunks
    from megatron_rl.models.hf_mapping import load_hf_into_megatron
    from megatron_rl.parallel import distributed

    arch = read_hf_config(args.hf_dir)
    layout, _ = checked_layout(args, arch)
    distributed.initialize(layout, arch=arch)
    reader = open_reader(args)
    if args.role == "critic":
        chunks = build_critic_chunks(arch, layout, use_transformer_engine=False)
        load_hf_into_megatron(chunks, reader, arch, skip={"output_layer.weight"})
        load_value_head(chunks, reader)
    else:
        chunks = build_gpt_model_chunks(arch, layout, use_transformer_engine=False)
        load_hf_into_megatron(chunks, reader, arch)
    save_role(chunks, None, args.work_dir)
    torch.distributed.barrier()
    distributed.destroy()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if under_torchrun():
        return record(worker)(args)
    arch = check_inputs(args)
    with atomic_output_dir(args.out_dir, args.overwrite) as tmp:
        world = checked_layout(args, arch)[1]
        launch_self(__spec__.name, argv, world, ["--work-dir", str(tmp)])
        copy_side_files(args.hf_dir, tmp / HF_META_SUBDIR)
        write_metadata(
            tmp,
            args.role,
            arch,
            saved_layout={"tp": args.tp, "pp": args.pp, "ep": args.ep, "etp": args.etp or args.tp},
            source=str(args.hf_dir.resolve()),
            lora=str(args.lora_dir.resolve()) if args.lora_dir else None,
        )
    print(f"wrote {args.out_dir} ({args.role}, saved at {describe(args)})")


if __name__ == "__main__":
    main()
    exit_now()  # past the interpreter's teardown of torch, megatron and vLLM
