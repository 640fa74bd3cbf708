"""Benchmark: Megatron -> vLLM weight sync vs a plain memory copy of the same bytes.

    python -m tools.bench weight_sync [--preset qwen2.5-0.5b]
    python -m tools.bench weight_sync --nproc-per-node 2 --tp 2     (or --pp 2)

One process (or torchrun world) holds the policy as Megatron chunks and a colocated vLLM
engine, as the trainer does. Three arms alternate, each moving the model's bytes once:
  - memcpy: `dst.copy_(src)` of a buffer as large as the engine's weights (the ceiling);
  - export: the Megatron side alone (TP all-gather, HF renaming, PP broadcast, dtype cast);
  - sync: `megatron_rl.sync.weight_sync.sync_weights`, export + vLLM's in-place reload;
  - sync_lora (with --lora-rank R): the same sync of a LoRA policy (rank R on every linear),
    whose adapted linears are exported merged, W + s B A per shard (`actor.lora.merge: true`,
    a first sync); sync_lora_adapted: the adapted linears' tensors alone, as every later
    merged sync sends them (`sync/lora_sync.py`);
  - sync_adapter (with --lora-rank R): the adapters alone, as `actor.lora.merge: false` syncs
    after its first push (`sync/lora_sync.py`: TP gather, a PEFT adapter written, vLLM's
    LoRA request), then a 3-token score, which makes vLLM load it; `score`, that score alone,
    is subtracted in `ratio_sync_adapter_over_sync_lora_s`;
  - generate_merged / generate_adapter (with --lora-rank R): 8 prompts x 2 samples x 32 new
    tokens right after each kind of sync, the price of serving the adapter in vLLM's LoRA
    layers (`ratio_generate_adapter_over_merged_tokens_per_s`).
Prints GB/s of each and sync/memcpy; one JSON line, appended to --out. The checkpoint is a
random one of the preset's shape (values do not matter for the speed). With --lora-rank the
engine serves LoRA (vLLM's `enable_lora`) for every arm.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from megatron_rl.models.hf_mapping import expected_hf_shapes
from megatron_rl.models.lora import LoRAConfig
from megatron_rl.models.presets import PRESETS, param_count, preset_arch
from megatron_rl.parallel import distributed
from megatron_rl.procutil import exit_now
from megatron_rl.rollout.types import EngineConfig, SamplingConfig
from megatron_rl.rollout.vllm_engine import VLLMEngine
from megatron_rl.sync.lora_sync import LoRASync
from megatron_rl.sync.weight_sync import (
    WeightSyncConfig,
    all_stage_tensors,
    checked,
    sync_weights,
)
from megatron_rl.workers.policy import ReferencePolicy
from megatron_rl.workers.spec import RoleModel
from tools.bench_common import alternate, record


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen2.5-0.5b")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--bucket-mb", type=float, default=WeightSyncConfig.bucket_mb)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lora-rank", type=int, default=0, help="also time a LoRA policy's sync")
    p.add_argument("--out", default="bench/results.jsonl")
    a = p.parse_args(argv)

    arch = preset_arch(a.preset)
    layout = distributed.ParallelLayout(
        tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=a.pp
    )
    ctx = distributed.initialize(layout, arch=arch)
    # Rank 0 writes the checkpoint; the broadcast of its path is also the barrier.
    work = Path(tempfile.mkdtemp(prefix="bench_weight_sync-")) if ctx.rank == 0 else None
    try:
        if work is not None:
            from examples.tiny_model import make_tiny_model, spec_for_preset

            make_tiny_model(work / "model", spec_for_preset(a.preset, max_position=2048))
        hf_dir = _rank0_path(work / "model" if work else None, ctx)
        policy = ReferencePolicy(RoleModel(arch, layout, model_path=hf_dir))
        if a.lora_rank:
            lora = LoRAConfig(rank=a.lora_rank, alpha=2.0 * a.lora_rank)
            adapted = ReferencePolicy(RoleModel(arch, layout, model_path=hf_dir, lora=lora))
        engine = VLLMEngine(
            hf_dir,
            EngineConfig(
                tensor_parallel_size=layout.model_parallel_size,
                dtype="bfloat16" if torch.cuda.is_available() else "float32",
                max_model_len=2048,
                external_launcher="WORLD_SIZE" in os.environ,
                max_lora_rank=a.lora_rank,
            ),
        )
        config = WeightSyncConfig(bucket_mb=a.bucket_mb)
        expected = expected_hf_shapes(arch, "actor")
        nbytes = sum(torch.Size(s).numel() for s in expected.values()) * engine.dtype.itemsize
        device = ctx.device
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)

        def export():
            stream = all_stage_tensors(policy.chunks, arch, int(config.bucket_mb * 2**20))
            for _ in checked(stream, expected, engine.dtype):
                pass

        arms = {
            "memcpy": lambda: dst.copy_(src),
            "export": export,
            "sync": lambda: sync_weights(policy, engine, config),
        }
        if a.lora_rank:
            adapters = LoRASync(
                replace(lora, merge=False),
                _rank0_path(work / "adapter_sync" if work else None, ctx),
                str(hf_dir),
            )

            def sync_adapter():
                adapters.push_adapters(adapted, engine)
                engine.score([[1, 2, 3]])

            prompts = [[3 + (7 * i + j) % 300 for j in range(16)] for i in range(8)]
            sampling = SamplingConfig(n=2, max_new_tokens=32)
            generated = {}

            def generate(arm):
                samples = engine.generate(prompts, sampling, seeds=list(range(len(prompts))))
                generated[arm] = sum(s.response_length for s in samples)

            # in this order: each generation runs on the sync just before it
            arms["sync_lora"] = lambda: sync_weights(adapted, engine, config)
            arms["sync_lora_adapted"] = lambda: sync_weights(
                adapted, engine, config, names=adapters.adapted
            )
            arms["generate_merged"] = lambda: generate("generate_merged")
            arms["sync_adapter"] = sync_adapter
            arms["generate_adapter"] = lambda: generate("generate_adapter")
            arms["score"] = lambda: engine.score([[1, 2, 3]])
        seconds = alternate(arms, a.steps)
        engine.shutdown()
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    moving = ("memcpy", "export", "sync", "sync_lora")  # the arms that move the whole model
    gbps = {arm: nbytes / s / 1e9 for arm, s in seconds.items() if arm in moving}
    if ctx.rank == 0:
        result = {
            "preset": a.preset,
            "params_b": round(param_count(arch) / 1e9, 3),
            "layout": f"TP{a.tp}PP{a.pp}",
            "engine_dtype": str(engine.dtype).removeprefix("torch."),
            "gb_moved": round(nbytes / 1e9, 3),
            "steps": a.steps,
            **{f"{arm}_s": round(s, 4) for arm, s in seconds.items()},
            **{f"{arm}_gb_per_s": round(g, 2) for arm, g in gbps.items()},
            "ratio_sync_over_memcpy_gb_per_s": round(gbps["sync"] / gbps["memcpy"], 4),
            "export_share_of_sync": round(seconds["export"] / seconds["sync"], 4),
        }
        if a.lora_rank:
            result["lora_rank"] = a.lora_rank
            result["ratio_sync_lora_over_sync_s"] = round(seconds["sync_lora"] / seconds["sync"], 4)
            result["ratio_sync_lora_adapted_over_sync_lora_s"] = round(
                seconds["sync_lora_adapted"] / seconds["sync_lora"], 4
            )
            adapter_s = seconds["sync_adapter"] - seconds["score"]
            result["ratio_sync_adapter_over_sync_lora_s"] = round(
                adapter_s / seconds["sync_lora"], 4
            )
            speed = {arm: generated[arm] / seconds[arm] for arm in generated}
            result["generated_tokens"] = generated
            result["ratio_generate_adapter_over_merged_tokens_per_s"] = round(
                speed["generate_adapter"] / speed["generate_merged"], 4
            )
        record("weight_sync", result, a.out)
    distributed.destroy()


def _rank0_path(path: Path | None, ctx) -> Path:
    """Every rank gets rank 0's path (one file system)."""
    box = [str(path) if path is not None else None]
    if ctx.world_size > 1:
        torch.distributed.broadcast_object_list(box, src=0)
    return Path(box[0])


if __name__ == "__main__":
    main()
    exit_now()  # past the interpreter's teardown of torch, megatron and vLLM
