"""torchrun worker: a LoRA actor (and critic) under the layouts named in --layouts, one after
another in this job, on one global batch.

At each layout the actor loads the HF base, gets adapters with the same nonzero values at
every layout (B is zero at initialisation: it is set here, sliced from one global tensor per
layer), and writes (rank 0 unless said):
- `{layout}.rank{r}.pt`: this DP rank's rows, log-probs with the adapters on and off, the
  parameters that train, what DDP's buffers and the optimizer hold, the frozen parameters'
  gradients, the critic's trained parameters;
- `{layout}/adapter/`: the adapters as a PEFT directory; `{layout}/stepped/`: after one
  optimizer step; `{layout}/merged.pt`: the merged HF tensors (the weight sync's stream);
- with --save-from LAYOUT: that layout's checkpoint after its step (`ckpt/`, with the
  metadata of a training checkpoint's actor), which every later layout loads into a fresh
  actor and exports (`{layout}/resumed/`).
"""

import argparse
import multiprocessing
import zlib
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from megatron_rl.models.dist_checkpoint import (
    HF_META_SUBDIR,
    copy_side_files,
    load_role,
    save_role,
    write_metadata,
)
from megatron_rl.models.hf_config import read_hf_config
from megatron_rl.models.hf_mapping import fc1_shard
from megatron_rl.models.lora import LORA_METADATA, LoRAConfig, global_layer_name, lora_modules
from megatron_rl.models.peft_export import save_peft_adapter
from megatron_rl.parallel import distributed
from megatron_rl.procutil import exit_now
from megatron_rl.sync.weight_sync import all_stage_tensors
from megatron_rl.workers.critic import Critic
from megatron_rl.workers.losses_config import PolicyLossConfig
from megatron_rl.workers.optimizer import OptimConfig
from megatron_rl.workers.policy import Actor, AdapterOffReference
from megatron_rl.workers.spec import RoleModel
from tests.torchrun.actor_critic import global_batch

Layout = distributed.ParallelLayout
LAYOUTS = {
    "single": Layout(),
    "dp2": Layout(),
    "tp2": Layout(tensor_model_parallel_size=2),
    "tp2_sp": Layout(tensor_model_parallel_size=2, sequence_parallel=True),
    "pp2_vpp2": Layout(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
    "ep2": Layout(expert_model_parallel_size=2),
}
DENSE_LORA = LoRAConfig(rank=4, alpha=8.0)
OPTIM = OptimConfig(lr=1e-2, weight_decay=0.0, adam_eps=1e-3)
"""eps far above the gradients' rounding noise: Adam's first step, g / (|g| + eps), is then
as close at two layouts as their gradients are (with eps 1e-8 it is the sign of a ~0 entry)."""
MOE_LORA = LoRAConfig(rank=4, alpha=8.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))


def set_adapters(chunks) -> None:
    """B (and A) from one global tensor per layer, sliced to this rank's shard: the same
    adapted model at every layout."""
    for i, name, m in lora_modules(chunks):
        full = global_layer_name(chunks[i].module, name)
        g = torch.Generator().manual_seed(zlib.crc32(full.encode()))
        for factor in ("lora_A", "lora_B"):
            param = getattr(m, factor)
            shape = list(param.shape)
            axis = m.lora_axes.get(factor)
            if axis is not None:
                shape[axis] *= m.tp_group.size()
            value = 0.2 * torch.randn(shape, generator=g)
            tp, tp_rank = m.tp_group.size(), m.tp_group.rank()
            if m.lora_gated and factor == "lora_B":  # [gate; up] whole -> [gate_r; up_r]
                value = fc1_shard(*value.chunk(2, dim=0), tp_rank, tp)
            elif axis is not None:
                value = value.chunk(tp, dim=axis)[tp_rank]
            with torch.no_grad():
                param.copy_(value)


def mkdir(path: Path) -> Path:
    if torch.distributed.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    return path


def run_layout(name, arch, hf_dir, batch, out, save_from):
    from megatron.core import parallel_state

    layout = LAYOUTS[name]
    ctx = distributed.initialize(layout, arch=arch)
    lora = MOE_LORA if arch.is_moe else DENSE_LORA
    rows_per_rank = len(batch) // ctx.dp_size
    rows = slice(ctx.dp_rank * rows_per_rank, (ctx.dp_rank + 1) * rows_per_rank)
    local = batch.rows(rows)
    model = RoleModel(arch, layout, model_path=hf_dir, lora=lora)
    actor = Actor(model, optim=OPTIM)
    set_adapters(actor.chunks)
    here = mkdir(out / name)
    result = {"rows": (rows.start, rows.stop)}
    result["on"] = actor.compute_logprobs(local, 2)
    result["off"] = AdapterOffReference(actor).compute_logprobs(local, 2)
    result["on_again"] = actor.compute_logprobs(local, 2)
    result["merged"] = {k: v.clone() for k, v in all_stage_tensors(actor.chunks, arch, 2**20)}
    save_peft_adapter(actor.chunks, arch, lora, mkdir(here / "adapter"), hf_dir)

    params = [(n, p) for c in actor.chunks for n, p in c.module.named_parameters()]
    result["trained"] = sorted(n for n, p in params if p.requires_grad)
    result["frozen"] = len([n for n, p in params if not p.requires_grad])
    result["ddp_numel"] = sum(b.grad_data.numel() for c in actor.chunks for b in c.buffers)
    result["trained_numel"] = sum(p.numel() for _, p in params if p.requires_grad)
    result["optimizer_numel"] = sum(
        p.numel() for g in actor.optimizer.param_groups for p in g["params"]
    )
    metrics = actor.update(local, PolicyLossConfig(nll_coef=0.1), 2)
    result["update_ok"] = metrics["update_ok"]
    result["frozen_grads"] = [
        n
        for n, p in params
        if not p.requires_grad and (p.grad is not None or getattr(p, "main_grad", None) is not None)
    ]
    result["stepped_on"] = actor.compute_logprobs(local, 2)
    save_peft_adapter(actor.chunks, arch, lora, mkdir(here / "stepped"), hf_dir)
    if name == save_from:  # a training checkpoint's actor directory, as the trainer writes it
        save_role(actor.chunks, actor.optimizer, out / "ckpt")
        # the writer's results came through an in-process queue: no helper process is left
        # that a job's SIGTERM would kill during a save (`dist_checkpoint`)
        assert multiprocessing.active_children() == [], multiprocessing.active_children()
        if ctx.rank == 0:
            meta = {LORA_METADATA: lora.to_dict()}
            write_metadata(out / "ckpt", "actor", arch, source=hf_dir, **meta)
            copy_side_files(Path(hf_dir), out / "ckpt" / HF_META_SUBDIR)
    elif (out / "ckpt").exists():
        fresh = Actor(model, optim=OPTIM)
        load_role(fresh.chunks, fresh.optimizer, out / "ckpt")
        save_peft_adapter(fresh.chunks, arch, lora, mkdir(here / "resumed"), hf_dir)

    if arch.is_moe:  # every linear, the experts' included: refused, naming one
        try:
            Actor(RoleModel(arch, layout, model_path=hf_dir, lora=DENSE_LORA))
        except ValueError as e:
            result["experts_refused"] = str(e)
    critic = Critic(RoleModel(arch, layout, model_path=hf_dir, lora=lora))
    result["critic_trained"] = sorted(
        n for c in critic.chunks for n, p in c.module.named_parameters() if p.requires_grad
    )
    torch.save(result, here / f"rank{ctx.rank}.pt")
    parallel_state.destroy_model_parallel()


@record
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--layouts", required=True, help="comma-separated names of LAYOUTS")
    p.add_argument("--save-from", default=None)
    a = p.parse_args()
    arch = read_hf_config(a.hf_dir)
    batch = global_batch(arch.vocab_size)
    for name in a.layouts.split(","):
        run_layout(name, arch, a.hf_dir, batch, Path(a.out_dir), a.save_from)
    distributed.destroy()


if __name__ == "__main__":
    main()
    exit_now()  # past the interpreter's teardown of torch, megatron and vLLM
