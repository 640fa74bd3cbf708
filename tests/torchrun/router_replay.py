"""torchrun worker (2 ranks): rollout routing replay end to end on a tiny mixture of experts.

A vLLM engine per rank records the experts it routed each token to; rank 0's samples are
the batch on every rank. The actor then computes log-probs with its routers replaying those
routes (R3), and routing on its own while recording where it differs (log_mismatch); the
same with foreign routes (random distinct experts per token and layer); and the gradient of
one update on the foreign routes, with and without full activation recompute (the recompute
must replay them too). Also a generation a stop cut, continued: its routes. Rank 0 writes
everything to --out.
"""

import argparse
import dataclasses

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from megatron_rl.data.batch import samples_to_batch
from megatron_rl.models.gpt import RecomputeConfig
from megatron_rl.models.hf_config import read_hf_config
from megatron_rl.models.hf_mapping import export_hf_tensors
from megatron_rl.models.router_replay import RouterReplayConfig
from megatron_rl.parallel import distributed
from megatron_rl.procutil import exit_now
from megatron_rl.rollout.types import EngineConfig, GenerationStopped, SamplingConfig
from megatron_rl.rollout.vllm_engine import VLLMEngine
from megatron_rl.workers.losses_config import PolicyLossConfig
from megatron_rl.workers.policy import Actor
from megatron_rl.workers.spec import RoleModel
from tests.torchrun.weight_sync import LAYOUTS as WEIGHT_SYNC_LAYOUTS

LAYOUTS = {name: WEIGHT_SYNC_LAYOUTS[name] for name in ("ep2", "tp2_sp_ep2")}


def foreign_routes(like: torch.Tensor, experts: int) -> torch.Tensor:
    """Random distinct experts for every token and layer, shaped like `like`."""
    g = torch.Generator().manual_seed(5)
    *lead, k = like.shape
    scores = torch.rand(*lead, experts, generator=g)
    return scores.topk(k, dim=-1).indices.to(like.dtype)


def stopped_and_continued(engine: VLLMEngine, prompts) -> list[tuple]:
    """A seeded call stopped at the engine's third check and continued (the first response
    given back finished, the others cut): (uninterrupted, continued) token ids and routes of
    each response. Every routed token of a continued response is re-prefilled under the
    same weights, so its routes are the uninterrupted call's."""
    sampling, seeds = SamplingConfig(n=2, max_new_tokens=40, ignore_eos=True), [3, 4]
    plain = engine.generate(prompts, sampling, seeds)
    checks = []
    try:
        engine.generate(
            prompts, sampling, seeds, should_stop=lambda: checks.append(1) or len(checks) == 3
        )
        raise RuntimeError("the stop at the third check did not stop the call")
    except GenerationStopped as stopped:
        cut = stopped.samples
    resumed = engine.generate(prompts, sampling, seeds, partial=[plain[0], *cut[1:]])
    return [
        (p.token_ids, p.routed_experts, r.token_ids, r.routed_experts, len(c.token_ids))
        for p, r, c in zip(plain, resumed, cut, strict=True)
    ]


@record
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--layout", choices=sorted(LAYOUTS), required=True)
    a = p.parse_args()
    arch = read_hf_config(a.hf_dir)
    layout = LAYOUTS[a.layout]
    ctx = distributed.initialize(layout, arch=arch)
    engine = VLLMEngine(
        a.hf_dir, EngineConfig(max_model_len=256, external_launcher=True, record_routes=True)
    )
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, arch.vocab_size, (n,), generator=g).tolist() for n in (5, 9)]
    samples = [engine.generate(prompts, SamplingConfig(n=2, max_new_tokens=12))]
    result = {"continued": stopped_and_continued(engine, prompts)}
    torch.distributed.broadcast_object_list(samples, src=0)  # one batch on every rank
    batch = samples_to_batch(samples[0])
    g = torch.Generator().manual_seed(0)
    batch = batch.with_fields(
        advantages=torch.randn(batch.input_ids.shape, generator=g),
        old_logprobs=torch.full(batch.input_ids.shape, -3.0),
    )
    foreign = batch.with_fields(
        routed_experts=foreign_routes(batch.routed_experts, arch.num_moe_experts)
    )
    model = RoleModel(arch, layout, model_path=a.hf_dir)
    r3 = Actor(model, router_replay=RouterReplayConfig("R3"))
    free = Actor(model, router_replay=RouterReplayConfig(log_mismatch=True))
    result.update(batch=batch, foreign=foreign)
    result["replayed"] = r3.compute_logprobs(batch)
    result["free"] = free.compute_logprobs(batch)
    result["own_mismatch"] = free.routing_metrics
    result["forced"] = r3.compute_logprobs(foreign)
    free.compute_logprobs(foreign)
    result["foreign_mismatch"] = free.routing_metrics
    recomputing = Actor(
        dataclasses.replace(model, recompute=RecomputeConfig(granularity="full")),
        router_replay=RouterReplayConfig("R3"),
    )
    for name, actor in (("grads", r3), ("recomputed_grads", recomputing)):
        actor.compute_gradients(foreign, PolicyLossConfig(), num_microbatches=2)
        result[name] = dict(export_hf_tensors(actor.chunks, arch, grads=True))
    free.compute_gradients(foreign, PolicyLossConfig(), num_microbatches=2)
    result["free_grads"] = dict(export_hf_tensors(free.chunks, arch, grads=True))
    if ctx.rank == 0:
        torch.save(result, a.out)
    engine.shutdown()
    distributed.destroy()


if __name__ == "__main__":
    main()
    exit_now()  # past the interpreter's teardown of torch, megatron and vLLM
