"""megatron-core distributed checkpoint -> Hugging Face safetensors (+ config and tokenizer).

    python -m checkpoints_convert.megatron_to_hf --ckpt-dir C --out-dir D [--role actor|critic]
        [--tp N --pp M --ep E --etp T]

--ckpt-dir: a converted checkpoint (hf_to_megatron), a training checkpoint
(`output_dir/checkpoints/step_N`, with --role), or a run's `output_dir` (its `latest`
checkpoint). The checkpoint is loaded at --tp/--pp (and --ep/--etp for a mixture of experts;
any layout: more processes, less memory each). Each pipeline stage streams its tensors, TP shards gathered one parameter at a time,
into safetensors files of at most --max-shard-mb; vocabulary padding is removed. Actors export
as causal LMs, critics as sequence-classification models (`score.weight`, one label).

A LoRA training checkpoint (`actor.lora`: it holds the adapters alone) exports merged into
the base model it was trained from (its `source`), or with --adapter as a PEFT adapter
directory of that base (`adapter_config.json`, `adapter_model.safetensors`; an actor's).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from checkpoints_convert.common import (
    HF_META_SUBDIR,
    METADATA,
    add_layout_args,
    atomic_output_dir,
    checked_layout,
    describe,
    fail,
    launch_self,
    load_megatron_checkpoint,
    read_metadata,
    under_torchrun,
)
from megatron_rl.procutil import exit_now


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--role", choices=["actor", "critic"], default=None)
    add_layout_args(p)
    p.add_argument("--max-shard-mb", type=int, default=4096)
    p.add_argument("--overwrite", action="store_true")
    p.add_argument(
        "--adapter", action="store_true", help="a LoRA checkpoint's adapters as a PEFT directory"
    )
    p.add_argument("--work-dir", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args) -> None:
    from megatron_rl.models.hf_export import save_hf_pretrained
    from megatron_rl.parallel import distributed

    layout, _ = checked_layout(args, read_metadata(args.ckpt_dir)[1])
    distributed.initialize(layout)
    if args.adapter:
        return adapter_worker(args, layout)
    chunks, arch, meta = load_megatron_checkpoint(args.ckpt_dir, layout)
    max_bytes = args.max_shard_mb * 2**20
    save_hf_pretrained(
        chunks, arch, meta["role"], args.ckpt_dir / HF_META_SUBDIR, args.work_dir, max_bytes
    )
    distributed.destroy()


def adapter_worker(args, layout) -> None:
    """The adapters alone, as PEFT's directory (the base weights are never read)."""
    from megatron_rl.models.dist_checkpoint import load_role
    from megatron_rl.models.gpt import build_gpt_model_chunks
    from megatron_rl.models.lora import LORA_METADATA, LoRAConfig, apply_lora
    from megatron_rl.models.peft_export import save_peft_adapter
    from megatron_rl.parallel import distributed

    meta, arch = read_metadata(args.ckpt_dir)
    lora = LoRAConfig.from_dict(meta[LORA_METADATA])
    chunks = build_gpt_model_chunks(arch, layout, use_transformer_engine=False)
    apply_lora(chunks, lora)
    load_role(chunks, None, args.ckpt_dir)
    save_peft_adapter(chunks, arch, lora, args.work_dir, meta["source"])
    distributed.destroy()


def role_dir(ckpt_dir: Path, role: str | None) -> Path:
    """The directory holding one role's checkpoint (see the module docstring)."""
    path = Path(ckpt_dir)
    if (path / METADATA).exists():
        saved = read_metadata(path)[0]["role"]
        if role not in (None, saved):
            fail(f"{path / METADATA}: a {saved} checkpoint, not --role {role}")
        return path
    for pointer in (path / "checkpoints" / "latest", path / "latest"):
        if pointer.exists():
            path = pointer.parent / pointer.read_text().strip()
            break
    found = path / (role or "actor") / METADATA
    if not found.exists():
        fail(
            f"{found} not found: --ckpt-dir {ckpt_dir} is not a megatron_rl checkpoint, a "
            f"training checkpoint holding the {role or 'actor'}, or a run's output_dir"
        )
    return found.parent


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if under_torchrun():
        return record(worker)(args)
    args.ckpt_dir = role_dir(args.ckpt_dir, args.role)
    argv = [*argv, "--ckpt-dir", str(args.ckpt_dir)]  # the workers load the resolved one
    meta, arch = read_metadata(args.ckpt_dir)
    # why: torch and the model code load only once the arguments are known to be good
    from megatron_rl.models.lora import LORA_METADATA

    if args.adapter and not (meta.get(LORA_METADATA) and meta["role"] == "actor"):
        fail(f"--adapter: {args.ckpt_dir} is not a LoRA actor checkpoint (it has no lora)")
    _, world = checked_layout(args, arch)
    with atomic_output_dir(args.out_dir, args.overwrite) as tmp:
        launch_self(__spec__.name, argv, world, ["--work-dir", str(tmp)])
    print(f"wrote {args.out_dir} ({meta['role']} of {args.ckpt_dir}, loaded at {describe(args)})")


if __name__ == "__main__":
    main()
    exit_now()  # past the interpreter's teardown of torch, megatron and vLLM
