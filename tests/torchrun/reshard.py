"""torchrun worker: an actor and a critic take one update on a fixed batch, are saved as the
trainer saves them (`trainer.checkpoint.save_roles`), and take a second update; `--load`
instead builds them at this run's layout, loads the save and takes that second update.
Writes (the last rank) the second update's metrics, the actor's log-probs after it, and both
roles' full Hugging Face tensors before and after it to --out; the saving run also the actor
after the second update from the saved weights without the saved Adam state.

    torchrun --nproc-per-node 2 -m tests.torchrun.reshard --hf-dir D --ckpt C --out F
        --tp 2 --pp 1 [--ep 2 --etp 1] [--load]

A mixture of experts at TP > 1 runs with sequence parallelism (megatron-core's rule).
"""

import argparse
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from megatron_rl.models.dist_checkpoint import load_role
from megatron_rl.models.hf_config import read_hf_config
from megatron_rl.models.hf_mapping import export_hf_tensors
from megatron_rl.parallel import distributed
from megatron_rl.procutil import exit_now
from megatron_rl.trainer.checkpoint import load_roles, save_roles
from megatron_rl.workers.critic import Critic
from megatron_rl.workers.losses_config import PolicyLossConfig, ValueLossConfig
from megatron_rl.workers.optimizer import OptimConfig
from megatron_rl.workers.policy import Actor
from megatron_rl.workers.spec import RoleModel
from tests.torchrun.actor_critic import global_batch


def full(role):
    """Every Hugging Face tensor of the role, on every rank (pipeline stages merged)."""
    mine = {k: v.clone() for k, v in export_hf_tensors(role.chunks, role.arch)}
    stages = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(stages, mine)
    return {k: v for stage in stages for k, v in stage.items()}


@record
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--ckpt", type=Path, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--etp", type=int)
    p.add_argument("--load", action="store_true")
    a = p.parse_args()
    arch = read_hf_config(a.hf_dir)
    layout = distributed.ParallelLayout(
        tensor_model_parallel_size=a.tp,
        pipeline_model_parallel_size=a.pp,
        sequence_parallel=arch.is_moe and a.tp > 1,
        expert_model_parallel_size=a.ep,
        expert_tensor_parallel_size=a.etp,
    )
    ctx = distributed.initialize(layout, arch=arch)
    batch = global_batch(arch.vocab_size)
    batch = batch.with_fields(ref_logprobs=batch.old_logprobs)
    optim = OptimConfig(lr=1e-3, weight_decay=0.01)
    model = RoleModel(arch, layout, model_path=a.hf_dir)
    actor = Actor(model, optim=optim)
    critic = Critic(model, optim=optim)
    roles = {"actor": actor, "critic": critic}
    policy, value = PolicyLossConfig(nll_coef=0.1), ValueLossConfig()
    if a.load:
        load_roles(a.ckpt, roles)
    else:
        actor.update(batch, policy, 2)
        critic.update(batch, value, 2)
        if ctx.rank == 0:
            a.ckpt.mkdir()
        torch.distributed.barrier()
        save_roles(a.ckpt, roles, dict.fromkeys(roles, a.hf_dir), {"tp": a.tp, "pp": a.pp})
    saved = {"actor": full(actor), "critic": full(critic)}
    metrics = {"actor": actor.update(batch, policy, 2), "critic": critic.update(batch, value, 2)}
    result = {
        "saved": saved,
        "metrics": metrics,
        "logprobs": actor.compute_logprobs(batch),
        "after": {"actor": full(actor), "critic": full(critic)},
    }
    if not a.load:  # the same weights with fresh Adam state
        fresh = Actor(RoleModel(arch, layout), optim=optim)
        load_role(fresh.chunks, None, a.ckpt / "actor")
        fresh.update(batch, policy, 2)
        result["model_only_after"] = full(fresh)
    if ctx.rank == ctx.world_size - 1:  # a last pipeline stage: it has the loss metrics
        torch.save(result, a.out)
    distributed.destroy()


if __name__ == "__main__":
    main()
    exit_now()  # past the interpreter's teardown of torch, megatron and vLLM
