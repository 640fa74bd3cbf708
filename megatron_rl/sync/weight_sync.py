"""Megatron -> vLLM weight sync: the actor's TP/PP shards become the engine's HF-named weights.

Dataflow of `sync_weights(actor, engine)`, on every rank of the torchrun world at once:
1. each pipeline stage exports its parameters under Hugging Face names, one parameter at a
   time, TP shards all-gathered (`export_hf_tensors`, the converters' mapping);
2. with PP > 1, each stage packs its tensors into buckets of at most `bucket_mb` (a tensor
   larger than a bucket travels alone) and broadcasts them over the PP group, stage after
   stage, so every rank's colocated engine receives the whole model;
3. every name and shape is checked against the model's expected weights (an unknown name or
   a wrong shape fails loudly, naming it: nothing is skipped);
4. the engine reloads in place (vLLM's `reload_weights`: its own loader fuses QKV and
   gate/up and shards for the engine's TP), in the engine's dtype; then the prefix cache,
   whose KV entries came from the old weights, is reset.
Host memory: one bucket (or one parameter) beyond the model shards; never a full copy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from megatron_rl.models.architecture import ModelArchitecture
from megatron_rl.models.hf_mapping import expected_hf_shapes, export_hf_tensors
from megatron_rl.parallel import distributed


@dataclass(frozen=True)
class WeightSyncConfig:
    bucket_mb: float = 512.0
    """Size of the buffers broadcast between pipeline stages."""


class WeightSyncError(ValueError):
    pass


def bucketed(
    tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group (name, tensor) pairs into lists of at most bucket_bytes (oversized ones alone)."""
    bucket, size = [], 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


def pack_bucket(bucket):
    """(meta: [(name, shape, dtype)], flat: the tensors' bytes end to end) of a bucket."""
    meta = [(name, tuple(t.shape), t.dtype) for name, t in bucket]
    flat = torch.cat([t.contiguous().view(-1).view(torch.uint8) for _, t in bucket])
    return meta, flat


def unpack_bucket(meta, flat):
    """The (name, tensor) pairs `pack_bucket` packed, each a copy out of `flat`."""
    offset = 0
    for name, shape, dtype in meta:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        yield name, flat[offset : offset + nbytes].view(dtype).view(shape).clone()
        offset += nbytes


def all_stage_tensors(
    chunks: list, arch: ModelArchitecture, bucket_bytes: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every HF tensor of the model on every rank (PP stages broadcast in buckets)."""
    # why: megatron-core takes seconds to import: loaded on first use
    from megatron.core import parallel_state

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if pp == 1:
        yield from export_hf_tensors(chunks, arch)
        return
    group = parallel_state.get_pipeline_model_parallel_group()
    ranks = torch.distributed.get_process_group_ranks(group)
    me = parallel_state.get_pipeline_model_parallel_rank()
    for stage in range(pp):
        if stage == me:
            for bucket in bucketed(export_hf_tensors(chunks, arch), bucket_bytes):
                meta, flat = pack_bucket(bucket)
                torch.distributed.broadcast_object_list(
                    [meta, flat.numel()], src=ranks[stage], group=group
                )
                torch.distributed.broadcast(flat, src=ranks[stage], group=group)
                yield from bucket
            torch.distributed.broadcast_object_list([None, 0], src=ranks[stage], group=group)
        else:
            while True:
                header = [None, 0]
                torch.distributed.broadcast_object_list(header, src=ranks[stage], group=group)
                meta, numel = header
                if meta is None:
                    break
                flat = torch.empty(numel, dtype=torch.uint8, device=distributed.device())
                torch.distributed.broadcast(flat, src=ranks[stage], group=group)
                yield from unpack_bucket(meta, flat)


def checked(
    tensors: Iterable[tuple[str, torch.Tensor]], expected: dict[str, tuple], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Cast to the engine's dtype; fail on an unknown name, a wrong shape or a missing weight."""
    seen = set()
    for name, t in tensors:
        if name not in expected:
            raise WeightSyncError(f"weight sync: {name!r} is not a weight of the engine's model")
        if tuple(t.shape) != expected[name]:
            raise WeightSyncError(
                f"weight sync: {name!r} has shape {list(t.shape)}, the engine expects "
                f"{list(expected[name])}"
            )
        seen.add(name)
        yield name, t.to(dtype)
    missing = sorted(set(expected) - seen)
    if missing:
        raise WeightSyncError(
            f"weight sync: {len(missing)} weights never arrived, e.g. {missing[:3]}"
        )


def sync_weights(
    actor,
    engine,
    config: WeightSyncConfig | None = None,
    names: Callable[[str], bool] | None = None,
) -> dict[str, float]:
    """Push the actor's current weights into the colocated vLLM engine, in place; with
    `names`, only the Hugging Face tensors it accepts, every one of them (the engine keeps
    the others: a LoRA actor's frozen weights, `sync/lora_sync.py`)."""
    config = config or WeightSyncConfig()
    t0 = time.perf_counter()
    stats = {"tensors": 0, "bytes": 0}

    def counted(tensors):
        for name, t in tensors:
            stats["tensors"] += 1
            stats["bytes"] += t.numel() * t.element_size()
            yield name, t

    stream = all_stage_tensors(actor.chunks, actor.arch, int(config.bucket_mb * 2**20))
    expected = expected_hf_shapes(actor.arch, "actor")
    if names is not None:
        stream = ((name, t) for name, t in stream if names(name))
        expected = {name: shape for name, shape in expected.items() if names(name)}
    engine.update_weights(counted(checked(stream, expected, engine.dtype)))
    seconds = time.perf_counter() - t0
    return {**stats, "seconds": seconds, "gb_per_s": stats["bytes"] / seconds / 1e9}
