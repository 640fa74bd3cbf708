"""torchrun worker (2 ranks, EP=2): the MoE router's losses and freezing, on one batch.

For each MoEConfig in CASES: the actor's metrics of one `compute_gradients` and its router
gradient; "z-padded" runs the z-loss case on the batch with 9 more padding columns. "frozen"
also takes an optimizer step. Rank 0 writes {case: {...}} to --out.
"""

import argparse

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from megatron_rl.models.gpt import MoEConfig
from megatron_rl.models.hf_config import read_hf_config
from megatron_rl.models.hf_mapping import export_hf_tensors
from megatron_rl.parallel import distributed
from megatron_rl.procutil import exit_now
from megatron_rl.workers.losses_config import PolicyLossConfig
from megatron_rl.workers.optimizer import OptimConfig
from megatron_rl.workers.policy import Actor
from megatron_rl.workers.spec import RoleModel
from tests.torchrun.actor_critic import global_batch

CASES = {
    "plain": MoEConfig(),
    "aux": MoEConfig(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.1),
    "z": MoEConfig(moe_z_loss_coeff=0.01),
    "z-padded": MoEConfig(moe_z_loss_coeff=0.01),
    "frozen": MoEConfig(freeze_moe_router=True),
}
ROUTER = "model.layers.0.mlp.gate.weight"
EXPERT = "model.layers.1.mlp.experts.5.down_proj.weight"


@record
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    arch = read_hf_config(a.hf_dir)
    layout = distributed.ParallelLayout(expert_model_parallel_size=2)
    ctx = distributed.initialize(layout, arch=arch)
    batch = global_batch(arch.vocab_size).rows(slice(4 * ctx.dp_rank, 4 * ctx.dp_rank + 4))
    results = {}
    for name, moe in CASES.items():
        local = batch
        if name == "z-padded":
            local = batch.with_length(batch.seq_length + 9)
        optim = OptimConfig(lr=1e-3, weight_decay=0.0)
        actor = Actor(RoleModel(arch, layout, model_path=a.hf_dir, moe=moe), optim=optim)
        metrics = actor.compute_gradients(local, PolicyLossConfig(), num_microbatches=2)
        result = {"metrics": metrics}
        if name != "frozen":  # a frozen router has no gradient buffer
            grads = dict(export_hf_tensors(actor.chunks, arch, grads=True))
            result["router_grad"], result["expert_grad"] = grads[ROUTER], grads[EXPERT]
        else:
            before = {k: v.clone() for k, v in export_hf_tensors(actor.chunks, arch)}
            actor.apply_gradients(metrics)
            after = dict(export_hf_tensors(actor.chunks, arch))
            result["changed"] = sorted(k for k in before if not torch.equal(before[k], after[k]))
            result["trainable"] = sum(p.requires_grad for c in actor.chunks for p in c.parameters())
        results[name] = result
    if ctx.rank == 0:
        torch.save(results, a.out)
    distributed.destroy()


if __name__ == "__main__":
    main()
    exit_now()  # past the interpreter's teardown of torch, megatron and vLLM
