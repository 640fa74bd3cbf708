"""torchrun worker (3 ranks): a disaggregated placement, ranks 0-1 training, rank 2 an engine
rank (`parallel/placement.py`). The trainers build the actor with Megatron at TP=2 on their
own world of 2 and update it twice; trainer rank 0 pushes its Hugging Face tensors as policy
version 1 over the bridge (`sync/weight_push.py`); the engine rank, a vLLM engine on its own
world of 1, receives, checks and loads them, then scores the batch the actor trained on:
its log-probs against the actor's (sent over the bridge). A stop request made on trainer
rank 1 reaches the engine rank through the job's store. Each rank writes what it saw to
--out-dir/<role><rank>.pt."""

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from megatron_rl.models.hf_config import read_hf_config
from megatron_rl.models.hf_mapping import expected_hf_shapes, export_hf_tensors
from megatron_rl.parallel import distributed
from megatron_rl.parallel.placement import Placement, initialize_role
from megatron_rl.preemption import StopRequest
from megatron_rl.procutil import exit_now
from megatron_rl.sync.weight_push import (
    bridge_group,
    broadcast_object,
    push_weights,
    receive_weights,
)
from megatron_rl.sync.weight_sync import checked
from tests.torchrun.actor_critic import global_batch


@record
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--out-dir", required=True)
    a = p.parse_args()
    job_rank = int(os.environ["RANK"])
    placement = Placement(world_size=int(os.environ["WORLD_SIZE"]), engine_ranks=1)
    role, store = initialize_role(placement)
    seen = {"role": role, "role_rank": dist.get_rank(), "role_world": dist.get_world_size()}
    seen["env"] = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    # a collective of the role's own world: every member of the role, none of the other
    members = torch.ones(1)
    dist.all_reduce(members)
    seen["members"] = int(members.item())
    stop = StopRequest()
    stop.share_through(store, job_rank)
    arch = read_hf_config(a.hf_dir)
    bridge_rank = placement.bridge_rank(job_rank)
    bridge = (
        bridge_group(store, bridge_rank, placement.bridge_size) if bridge_rank is not None else None
    )

    batch = global_batch(arch.vocab_size)  # the same on every rank: made from a seed
    if role == "trainer":
        # why here: the actor needs Megatron, which the engine rank never imports
        from megatron_rl.workers.losses_config import PolicyLossConfig
        from megatron_rl.workers.optimizer import OptimConfig
        from megatron_rl.workers.policy import Actor
        from megatron_rl.workers.spec import RoleModel

        layout = distributed.ParallelLayout(tensor_model_parallel_size=2)
        distributed.initialize(layout, arch=arch)
        actor = Actor(RoleModel(arch, layout, model_path=a.hf_dir), optim=OptimConfig(lr=1e-3))
        for _ in range(2):
            actor.update(batch, PolicyLossConfig(), num_microbatches=2)
        tensors = export_hf_tensors(actor.chunks, arch)  # TP all-gathers: both trainers
        if bridge is not None:
            seen["sent"] = push_weights(bridge, tensors, version=1, bucket_bytes=64 * 1024)
        else:
            for _ in tensors:
                pass
        logprobs = actor.compute_logprobs(batch)
        if bridge is not None:
            broadcast_object(bridge, logprobs, root=0)
        else:
            stop._on_signal(signal.SIGUSR1, None)  # a signal only this rank got
            seen["stop"] = stop.reason  # its first check publishes it
        distributed.destroy()
    else:
        # why here: vLLM is slow to import and only the engine rank runs it
        from megatron_rl.rollout.parity import engine_token_logprobs, logprob_gap
        from megatron_rl.rollout.types import EngineConfig
        from megatron_rl.rollout.vllm_engine import VLLMEngine

        engine = VLLMEngine(a.hf_dir, EngineConfig(max_model_len=256, external_launcher=True))
        before = engine_token_logprobs(engine, batch)
        version, pairs = receive_weights(bridge)
        expected = expected_hf_shapes(arch, "actor")
        engine.update_weights(checked(pairs, expected, engine.dtype))
        after = engine_token_logprobs(engine, batch)
        actor_logprobs = broadcast_object(bridge, None, root=0)
        mask = batch.response_mask
        seen["version"] = version
        seen["gap"] = logprob_gap(after, actor_logprobs, mask)["logprob_gap_max"]
        seen["change"] = logprob_gap(after, before, mask)["logprob_gap_max"]
        deadline = time.time() + 60
        while not stop.requested and time.time() < deadline:
            time.sleep(0.05)
        seen["stop"] = stop.reason
        dist.destroy_process_group()
    torch.save(seen, Path(a.out_dir) / f"{role}{job_rank}.pt")


if __name__ == "__main__":
    main()
    exit_now()  # past the interpreter's teardown of torch, megatron and vLLM
