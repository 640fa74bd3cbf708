"""torchrun worker: the Actor and Critic under several parallel layouts on one global batch.

For each layout in --layouts (run one after another in this job; "-pack": packed
micro-batches), saves per rank:
actor gradients (HF names, full tensors) for two loss settings, critic gradients, this DP
rank's log-probs and values, the rows they belong to, and where those calls read tensors
back to the host (`tests/host_reads.py`) -> --out-dir/{layout}.rank{r}.pt.
"""

import argparse
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from megatron_rl.data.batch import TrainingBatch
from megatron_rl.models.hf_config import read_hf_config
from megatron_rl.models.hf_mapping import export_hf_tensors
from megatron_rl.parallel import distributed
from megatron_rl.parallel.collectives import balance_over_data_parallel
from megatron_rl.procutil import exit_now
from megatron_rl.workers.critic import Critic
from megatron_rl.workers.losses_config import PolicyLossConfig, ValueLossConfig
from megatron_rl.workers.policy import Actor
from megatron_rl.workers.spec import RoleModel
from tests.host_reads import HostReads

SP = distributed.ParallelLayout(tensor_model_parallel_size=2, sequence_parallel=True)
PP = distributed.ParallelLayout(pipeline_model_parallel_size=2)
EP = distributed.ParallelLayout(expert_model_parallel_size=2)
TOKEN_BUDGET = 40
"""Padded tokens per micro-batch in the "-tok" layouts: 1 to 3 of the batch's rows (4 to 23
tokens long) each, every micro-batch cut to its own length."""
# name -> (layout, split per DP rank: a number of equal micro-batches, or a token budget)
LAYOUTS = {
    "dp1-mb1": (distributed.ParallelLayout(), {"num_microbatches": 1}),
    "dp1-mb4": (distributed.ParallelLayout(), {"num_microbatches": 4}),
    "dp2-mb2": (distributed.ParallelLayout(), {"num_microbatches": 2}),
    "tp2": (distributed.ParallelLayout(tensor_model_parallel_size=2), {"num_microbatches": 2}),
    "tp2-sp": (SP, {"num_microbatches": 2}),
    "pp2": (PP, {"num_microbatches": 4}),
    "dp1-tok": (distributed.ParallelLayout(), {"max_tokens": TOKEN_BUDGET}),
    "dp2-tok": (distributed.ParallelLayout(), {"max_tokens": TOKEN_BUDGET}),
    "tp2-sp-tok": (SP, {"max_tokens": TOKEN_BUDGET}),
    "pp2-tok": (PP, {"max_tokens": TOKEN_BUDGET}),
    "vpp2-tok": (
        distributed.ParallelLayout(
            pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2
        ),
        {"max_tokens": TOKEN_BUDGET},
    ),
    # packed micro-batches (model.use_remove_padding): rows back to back, no padding
    "dp1-pack": (distributed.ParallelLayout(), {"num_microbatches": 2}),
    "tp2-pack": (distributed.ParallelLayout(tensor_model_parallel_size=2), {"num_microbatches": 2}),
    "tp2-sp-pack-tok": (SP, {"max_tokens": TOKEN_BUDGET}),
    "pp2-pack-tok": (PP, {"max_tokens": TOKEN_BUDGET}),
    # the rows re-dealt over the DP ranks by token count first (trainer.balance_batch)
    "dp2-bal": (distributed.ParallelLayout(), {"max_tokens": TOKEN_BUDGET}),
    # mixtures of experts: experts split over two ranks (tokens dispatched between them)
    "ep2": (EP, {"num_microbatches": 2}),
    "ep2-tok": (EP, {"max_tokens": TOKEN_BUDGET}),
    "tp2-sp-etp1": (
        distributed.ParallelLayout(
            tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=1
        ),
        {"num_microbatches": 2},
    ),
    "tp2-sp-ep2": (
        distributed.ParallelLayout(
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            expert_model_parallel_size=2,
            expert_tensor_parallel_size=1,
        ),
        {"num_microbatches": 2},
    ),
}
LOSSES = {
    "token-mean+nll": PolicyLossConfig(loss_agg_mode="token-mean", nll_coef=0.1),
    "seq-mean-token-mean": PolicyLossConfig(loss_agg_mode="seq-mean-token-mean"),
    "entropy+kl": PolicyLossConfig(entropy_coef=0.05, kl_loss_coef=0.1, dual_clip_c=3.0),
}


def global_batch(vocab_size: int, batch: int = 8, seq: int = 23, seed: int = 3) -> TrainingBatch:
    """Prompts of 3..8 tokens, responses of 1..(rest) tokens, right padding; an odd length
    so sequence parallelism must pad it."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (batch, seq), generator=g)
    mask = torch.zeros(batch, seq)
    for i in range(batch):
        prompt = int(torch.randint(3, 9, (1,), generator=g))
        length = 1 if i == 2 else int(torch.randint(1, seq - prompt + 1, (1,), generator=g))
        mask[i, prompt : prompt + length] = 1
    return TrainingBatch(
        input_ids=input_ids,
        response_mask=mask,
        old_logprobs=-2 - 5 * torch.rand(batch, seq, generator=g),
        ref_logprobs=-6 + 0.3 * torch.randn(batch, seq, generator=g),
        advantages=torch.randn(batch, seq, generator=g),
        returns=torch.randn(batch, seq, generator=g),
        old_values=0.1 * torch.randn(batch, seq, generator=g),
        scores=torch.tensor([1.0, -1.0] * (batch // 2)),
    )


def run_layout(name, arch, hf_dir, batch, out_dir):
    from megatron.core import parallel_state

    layout, split = LAYOUTS[name]
    ctx = distributed.initialize(layout, arch=arch)
    rows_per_rank = len(batch) // ctx.dp_size
    rows = slice(ctx.dp_rank * rows_per_rank, (ctx.dp_rank + 1) * rows_per_rank)
    local = batch.rows(rows)
    result = {"rows": (rows.start, rows.stop), "grads": {}, "metrics": {}}
    if name.endswith("-bal"):  # rank 0 starts with the longest rows, rank 1 the shortest
        by_length = torch.argsort(batch.sequence_lengths(), descending=True, stable=True)
        # on the device, as the trainer's batches are (rated_to_batch): NCCL takes no CPU tensor
        local = batch.rows(by_length[rows]).to(distributed.device())
        local, result["balance"] = balance_over_data_parallel(local)
        result["input_ids"] = local.input_ids

    pack = "-pack" in name
    model = RoleModel(arch, layout, model_path=hf_dir, use_remove_padding=pack)
    actor = Actor(model)
    reads = HostReads()
    for loss_name, cfg in LOSSES.items():
        with reads:
            result["metrics"][loss_name] = actor.compute_gradients(local, cfg, **split)
        result["grads"][loss_name] = dict(export_hf_tensors(actor.chunks, arch, grads=True))
    with reads:
        result["logprobs"] = actor.compute_logprobs(local, **split)

    critic = Critic(model)
    with reads:
        result["values"] = critic.compute_values(local, **split)
        result["metrics"]["critic"] = critic.compute_gradients(local, ValueLossConfig(), **split)
    result["host_reads"] = dict(reads.sites)
    result["critic_grads"] = dict(export_hf_tensors(critic.chunks, arch, grads=True))

    torch.save(result, Path(out_dir) / f"{name}.rank{ctx.rank}.pt")
    parallel_state.destroy_model_parallel()


@record
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--layouts", required=True, help="comma-separated names of LAYOUTS")
    a = p.parse_args()
    arch = read_hf_config(a.hf_dir)
    batch = global_batch(arch.vocab_size)
    for name in a.layouts.split(","):
        run_layout(name, arch, a.hf_dir, batch, a.out_dir)
    distributed.destroy()


if __name__ == "__main__":
    main()
    exit_now()  # past the interpreter's teardown of torch, megatron and vLLM
