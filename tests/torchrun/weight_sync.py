"""torchrun worker: two actor updates, then a weight sync; engine and actor log-probs agree.

Megatron layout (--layout tp2|pp2) and the colocated vLLM engine's TP (--vllm-tp; the engine
runs inside the torchrun world via vLLM's external launcher) are independent. Rank 0 writes
{gap_after_sync, change_from_sync, gap_before_sync, stats} to --out.
"""

import argparse

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from megatron_rl.data.batch import samples_to_batch
from megatron_rl.models.hf_config import read_hf_config
from megatron_rl.parallel import distributed
from megatron_rl.rollout.parity import engine_token_logprobs, logprob_gap
from megatron_rl.rollout.vllm_engine import EngineConfig, SamplingConfig, VLLMEngine
from megatron_rl.sync.weight_sync import WeightSyncConfig, sync_weights
from megatron_rl.workers.losses_config import PolicyLossConfig
from megatron_rl.workers.optimizer import OptimConfig
from megatron_rl.workers.policy import Actor

LAYOUTS = {
    "tp2": distributed.ParallelLayout(tensor_model_parallel_size=2),
    "pp2": distributed.ParallelLayout(pipeline_model_parallel_size=2),
}


@record
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--layout", choices=sorted(LAYOUTS), required=True)
    p.add_argument("--vllm-tp", type=int, default=1)
    p.add_argument("--bucket-mb", type=float, default=512)
    a = p.parse_args()
    arch = read_hf_config(a.hf_dir)
    layout = LAYOUTS[a.layout]
    ctx = distributed.initialize(layout, arch=arch)
    actor = Actor(
        arch=arch, layout=layout, model_path=a.hf_dir, optim=OptimConfig(lr=1e-3, weight_decay=0.0)
    )
    engine = VLLMEngine(
        a.hf_dir,
        EngineConfig(max_model_len=256, external_launcher=True, tensor_parallel_size=a.vllm_tp),
    )
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, arch.vocab_size, (5,), generator=g).tolist() for _ in range(3)]
    batch = samples_to_batch(engine.generate(prompts, SamplingConfig(n=2, max_new_tokens=12)))
    mask = batch.response_mask
    before = engine_token_logprobs(engine, batch)
    g = torch.Generator().manual_seed(0)
    batch = batch.with_fields(
        old_logprobs=actor.compute_logprobs(batch),
        advantages=torch.randn(batch.input_ids.shape, generator=g),
        scores=torch.tensor([1.0, -1.0] * (len(batch) // 2)),
    )
    gap_before = logprob_gap(before, batch.old_logprobs, mask)["logprob_gap_max"]
    for _ in range(2):
        actor.update(batch, PolicyLossConfig(nll_coef=0.1), num_microbatches=2)
    stats = sync_weights(actor, engine, WeightSyncConfig(bucket_mb=a.bucket_mb))
    after = engine_token_logprobs(engine, batch)
    gap_after = logprob_gap(after, actor.compute_logprobs(batch), mask)
    if ctx.rank == 0:
        torch.save(
            {
                "gap_before_sync": gap_before,
                "gap_after_sync": gap_after["logprob_gap_max"],
                "mean_gap_after_sync": gap_after["logprob_gap_mean"],
                "change_from_sync": logprob_gap(after, before, mask)["logprob_gap_max"],
                "response_tokens": int(mask.sum()),
                "stats": stats,
            },
            a.out,
        )
    distributed.destroy()


if __name__ == "__main__":
    main()
