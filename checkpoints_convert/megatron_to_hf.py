"""megatron-core distributed checkpoint -> Hugging Face safetensors (+ config and tokenizer).

    python -m checkpoints_convert.megatron_to_hf --ckpt-dir C --out-dir D [--role actor|critic]
        [--tp N --pp M]

--ckpt-dir: a converted checkpoint (hf_to_megatron), a training checkpoint
(`output_dir/checkpoints/step_N`, with --role), or a run's `output_dir` (its `latest`
checkpoint). The checkpoint is loaded at --tp/--pp (any layout: more processes, less memory
each). Each pipeline stage streams its tensors, TP shards gathered one parameter at a time,
into safetensors files of at most --max-shard-mb; vocabulary padding is removed. Actors export
as causal LMs, critics as sequence-classification models (`score.weight`, one label).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from checkpoints_convert.common import (
    HF_META_SUBDIR,
    METADATA,
    atomic_output_dir,
    checked_layout,
    copy_side_files,
    fail,
    launch_self,
    load_megatron_checkpoint,
    read_metadata,
    under_torchrun,
)
from megatron_rl.models.hf_config import HF_CLASS_PREFIX


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--role", choices=["actor", "critic"], default=None)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--max-shard-mb", type=int, default=4096)
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--work-dir", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


class ShardWriter:
    """Accumulates tensors and writes a safetensors file whenever max_bytes is reached."""

    def __init__(self, out_dir: Path, prefix: str, max_bytes: int):
        self.out_dir, self.prefix, self.max_bytes = out_dir, prefix, max_bytes
        self.pending: dict = {}
        self.pending_bytes = 0
        self.weight_map: dict[str, str] = {}
        self.files = 0

    def add(self, name: str, tensor) -> None:
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += tensor.numel() * tensor.element_size()
        if self.pending_bytes >= self.max_bytes:
            self.flush()

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        self.files += 1
        file = f"{self.prefix}-{self.files:05d}.safetensors"
        save_file(self.pending, self.out_dir / file, metadata={"format": "pt"})
        self.weight_map.update(dict.fromkeys(self.pending, file))
        self.pending, self.pending_bytes = {}, 0


def worker(args) -> None:
    import torch

    from megatron_rl import platform
    from megatron_rl.models.hf_mapping import export_hf_tensors

    layout = checked_layout(args.tp, args.pp)
    ctx = platform.initialize(layout)
    chunks, arch, _ = load_megatron_checkpoint(args.ckpt_dir, layout)
    writes = ctx.tp_rank == 0 and ctx.dp_rank == 0
    writer = ShardWriter(args.work_dir, f"model-pp{ctx.pp_rank}", args.max_shard_mb * 2**20)
    for name, tensor in export_hf_tensors(chunks, arch):  # every TP rank joins the gathers
        if writes:
            writer.add(name, tensor)
    writer.flush()
    maps = [None] * ctx.world_size
    torch.distributed.all_gather_object(maps, writer.weight_map)
    if ctx.rank == 0:
        weight_map = {k: v for m in maps for k, v in m.items()}
        index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
        (args.work_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    platform.destroy()


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


def write_side_files(meta_dir: Path, out: Path, role: str) -> None:
    """The source's config and tokenizer; a critic's config says what its weights are: a
    sequence-classification model with one label (its value head), whatever it started from."""
    copy_side_files(meta_dir, out)
    if role != "critic":
        return
    config = json.loads((out / "config.json").read_text())
    family = HF_CLASS_PREFIX[config["model_type"]]
    config.update(
        architectures=[f"{family}ForSequenceClassification"],
        id2label={"0": "LABEL_0"},
        label2id={"LABEL_0": 0},
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if under_torchrun():
        return record(worker)(args)
    args.ckpt_dir = role_dir(args.ckpt_dir, args.role)
    argv = [*argv, "--ckpt-dir", str(args.ckpt_dir)]  # the workers load the resolved one
    meta, arch = read_metadata(args.ckpt_dir)
    checked_layout(args.tp, args.pp, arch)
    with atomic_output_dir(args.out_dir, args.overwrite) as tmp:
        launch_self(__spec__.name, argv, args.tp * args.pp, ["--work-dir", str(tmp)])
        write_side_files(args.ckpt_dir / HF_META_SUBDIR, tmp, meta["role"])
    print(
        f"wrote {args.out_dir} ({meta['role']} of {args.ckpt_dir}, loaded at TP{args.tp}PP{args.pp})"
    )


if __name__ == "__main__":
    main()
