"""torchrun worker (2 ranks): for each Hugging Face checkpoint given, Megatron's logits at each
split of `splits(arch)`, and the HF tensors exported back from the most split model (shards
gathered, as the weight sync and the converter do).

Dense models: TP=1, TP=2, TP=2 with sequence parallelism. Mixtures of experts (megatron-core
trains them at TP > 1 only with sequence parallelism): TP=1, EP=2 (experts 0-3 on rank 0,
4-7 on rank 1, tokens dispatched by alltoall), TP=2+SP with the experts split over expert-TP 2,
TP=2+SP with EP=2 (expert-TP 1), and TP=1, EP=2 with the allgather dispatcher.

Writes --out-dir/{name}.pt (rank 0) with {"tokens", "exported", <split>: logits}.
"""

import argparse
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from megatron_rl.models.gpt import MoEConfig, build_gpt_model_chunks
from megatron_rl.models.hf_config import read_hf_config
from megatron_rl.models.hf_mapping import export_hf_tensors, load_hf_into_megatron
from megatron_rl.parallel import distributed
from megatron_rl.procutil import exit_now
from tests.torchrun.common import fixed_tokens, gather_vocab, position_ids

Layout = distributed.ParallelLayout
DENSE = {
    "tp1": Layout(),
    "tp2": Layout(tensor_model_parallel_size=2),
    "tp2_sp": Layout(tensor_model_parallel_size=2, sequence_parallel=True),
}
MOE = {
    "tp1": Layout(),
    "ep2": Layout(expert_model_parallel_size=2),
    "tp2_sp": Layout(tensor_model_parallel_size=2, sequence_parallel=True),
    "tp2_sp_ep2": Layout(
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        expert_model_parallel_size=2,
        expert_tensor_parallel_size=1,
    ),
    "ep2_allgather": Layout(expert_model_parallel_size=2),
}
EXPORTED_FROM = {False: "tp2", True: "tp2_sp_ep2"}


def run_layout(layout, arch, hf_dir, tokens, moe=None, export=False):
    ctx = distributed.initialize(layout, arch=arch)
    (model,) = build_gpt_model_chunks(arch, layout, moe=moe)
    load_hf_into_megatron([model], hf_dir, arch)
    with torch.no_grad():
        logits = gather_vocab(model(tokens, position_ids(tokens), None), arch.vocab_size)
    exported = dict(export_hf_tensors([model], arch)) if export else None
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    return ctx, logits, exported


@record
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hf-dirs", nargs="+", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--seq", type=int, default=96)
    a = p.parse_args()
    for hf_dir in a.hf_dirs:
        arch = read_hf_config(hf_dir)
        tokens = fixed_tokens(arch.vocab_size, seq=a.seq)
        result = dict(tokens=tokens)
        for split, layout in (MOE if arch.is_moe else DENSE).items():
            export = split == EXPORTED_FROM[arch.is_moe]
            moe = MoEConfig(moe_token_dispatcher_type="allgather") if "allgather" in split else None
            ctx, result[split], exported = run_layout(layout, arch, hf_dir, tokens, moe, export)
            if export:
                result["exported"] = exported
        if ctx.rank == 0:
            torch.save(result, Path(a.out_dir) / f"{Path(hf_dir).name}.pt")
    distributed.destroy()


if __name__ == "__main__":
    main()
    exit_now()  # past the interpreter's teardown of torch, megatron and vLLM
