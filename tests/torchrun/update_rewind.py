"""torchrun worker: `TrainableRole.snapshot_updates` / `rewind_updates` (workers/rewind.py) on
an actor at TP=2 with a warm-up schedule: updates taken after a snapshot are undone bit for
bit (weights, Adam state, schedule), from an unstepped optimizer and from a stepped one, and
redoing them gives the same bits as the first time. Writes a summary to --out (rank 0)."""

import argparse

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from megatron_rl.models.dist_checkpoint import inner_optimizers
from megatron_rl.models.hf_config import read_hf_config
from megatron_rl.parallel import distributed
from megatron_rl.procutil import exit_now
from megatron_rl.workers.losses_config import PolicyLossConfig
from megatron_rl.workers.optimizer import OptimConfig, current_lr
from megatron_rl.workers.policy import Actor
from megatron_rl.workers.spec import RoleModel
from tests.torchrun.actor_critic import global_batch


def update_state(actor) -> dict:
    """Copies of everything an update changes."""
    inner = [
        {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state[p].items()}
        for opt in inner_optimizers(actor.optimizer)
        for g in opt.param_groups
        for p in g["params"]
        if p in opt.state
    ]
    return {
        "weights": [p.detach().clone() for c in actor.chunks for p in c.parameters()],
        "adam": inner,
        "num_steps": actor.scheduler.num_steps,
        "groups": [(g["lr"], g["weight_decay"]) for g in actor.optimizer.param_groups],
    }


def same(a: dict, b: dict) -> bool:
    def equal(x, y):
        if isinstance(x, torch.Tensor):
            return torch.equal(x, y)
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(equal(x[k], y[k]) for k in x)
        if isinstance(x, list | tuple):
            return len(x) == len(y) and all(equal(u, v) for u, v in zip(x, y, strict=True))
        return x == y

    return equal(a, b)


def replace_state_tensors(actor) -> None:
    """As megatron's `offload_to_cpu`/`restore_from_cpu` do: new tensor objects in the state."""
    for opt in inner_optimizers(actor.optimizer):
        for state in opt.state.values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    state[k] = v.clone()


@record
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    arch = read_hf_config(a.hf_dir)
    layout = distributed.ParallelLayout(tensor_model_parallel_size=2)
    ctx = distributed.initialize(layout, arch=arch)
    batches = [global_batch(arch.vocab_size, seed=s) for s in (3, 4, 5)]
    # a warm-up: every update changes the learning rate the next one uses
    optim = OptimConfig(lr=1e-3, weight_decay=0.01, lr_warmup_steps=4, lr_warmup_init=1e-4)
    actor = Actor(RoleModel(arch, layout, model_path=a.hf_dir), optim=optim)
    cfg = PolicyLossConfig()

    def updates(bs) -> list[dict]:
        return [actor.update(b, cfg, 2) for b in bs]

    start = update_state(actor)
    actor.snapshot_updates()  # unstepped: no Adam state yet
    first = updates(batches[:2])
    after_two = update_state(actor)
    lr_after_two = current_lr(actor.optimizer)
    replace_state_tensors(actor)
    actor.rewind_updates()
    rewound_unstepped = update_state(actor)
    redone = updates(batches[:2])
    redone_state = update_state(actor)

    actor.snapshot_updates()  # stepped: Adam moments and steps, 2 schedule updates
    host = [h.data_ptr() for h in actor.update_snapshot.host]
    updates(batches[2:])
    replace_state_tensors(actor)
    actor.rewind_updates()
    rewound_stepped = update_state(actor)
    actor.snapshot_updates()
    summary = {
        "start_has_no_adam_state": start["adam"] == [],
        "after_two_has_adam_state": len(after_two["adam"]) == len(after_two["weights"]),
        "weights_moved": not same(start["weights"], after_two["weights"]),
        "lr_moved": lr_after_two != optim.lr_warmup_init,
        "rewound_unstepped": same(rewound_unstepped, start),
        "redone_metrics": first == redone,
        "redone_state": same(redone_state, after_two),
        "rewound_stepped": same(rewound_stepped, after_two),
        "lr_after_two": lr_after_two,
        "lr_rewound": current_lr(actor.optimizer),
        "host_buffers_reused": host == [h.data_ptr() for h in actor.update_snapshot.host],
        "host_bytes": actor.update_snapshot.nbytes,
        "rank": ctx.rank,
    }
    if ctx.rank == 0:
        torch.save(summary, a.out)
    distributed.destroy()


if __name__ == "__main__":
    main()
    exit_now()  # past the interpreter's teardown of torch, megatron and vLLM
