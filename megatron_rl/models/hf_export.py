"""Megatron chunks -> a Hugging Face directory (safetensors shards, index, config, tokenizer),
the inverse of `hf_mapping.load_hf_into_megatron`. Used by `checkpoints_convert.megatron_to_hf`
and by the trainer's `trainer.save_hf_interval`.

Every rank calls `save_hf_pretrained` (the TP gathers are collectives). The first TP/DP rank of
each pipeline stage writes that stage's tensors, gathered one parameter at a time, into files
of at most `max_shard_bytes`; rank 0 writes the index and the side files. Actors are causal LMs;
critics are sequence-classification models with one label (the value head as `score.weight`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from megatron_rl.models.architecture import ModelArchitecture
from megatron_rl.models.dist_checkpoint import copy_side_files
from megatron_rl.models.hf_config import HF_CLASS_PREFIX
from megatron_rl.models.hf_mapping import export_hf_tensors

INDEX = "model.safetensors.index.json"


class ShardWriter:
    """Accumulates tensors and writes a safetensors file whenever max_bytes is reached."""

    def __init__(self, out_dir: Path, prefix: str, max_bytes: int):
        self.out_dir, self.prefix, self.max_bytes = Path(out_dir), prefix, max_bytes
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
        if not self.pending:
            return
        self.files += 1
        file = f"{self.prefix}-{self.files:05d}.safetensors"
        save_file(self.pending, self.out_dir / file, metadata={"format": "pt"})
        self.weight_map.update(dict.fromkeys(self.pending, file))
        self.pending, self.pending_bytes = {}, 0


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


def save_hf_pretrained(
    chunks: list,
    arch: ModelArchitecture,
    role: str,
    meta_dir: Path,
    out_dir: Path,
    max_shard_bytes: int = 4 * 2**30,
) -> None:
    """Write this role as a Hugging Face model into `out_dir` (existing, seen by every rank).
    `meta_dir`: where the source's config and tokenizer are."""
    # why: megatron-core takes seconds to import: loaded on first use
    from megatron.core import parallel_state

    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    writes = (
        parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank() == 0
    )
    writer = ShardWriter(out_dir, f"model-pp{pp_rank}", max_shard_bytes)
    for name, tensor in export_hf_tensors(chunks, arch):  # every TP rank joins the gathers
        if writes:
            writer.add(name, tensor)
    writer.flush()
    maps = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(maps, writer.weight_map)
    if torch.distributed.get_rank() == 0:
        weight_map = {k: v for m in maps for k, v in m.items()}
        index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
        (Path(out_dir) / INDEX).write_text(json.dumps(index, indent=2))
        write_side_files(Path(meta_dir), Path(out_dir), role)
    torch.distributed.barrier()  # the directory is complete when any rank returns
