"""torchrun worker: the same HF weights under TP=1, TP=2 and TP=2 with sequence parallelism
give the same logits; backward runs under TP=2.

Writes {"tokens", "tp1", "tp2", "tp2_sp", "grad_params", "num_params", "grad_finite"} to
--out (rank 0). All layouts run in one job: Megatron's groups are rebuilt between them.
"""

import argparse

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from megatron_rl.models.gpt import build_gpt_model_chunks
from megatron_rl.models.hf_config import read_hf_config
from megatron_rl.models.hf_mapping import load_hf_into_megatron
from megatron_rl.parallel import distributed
from megatron_rl.procutil import exit_now
from tests.torchrun.common import fixed_tokens, gather_vocab, position_ids


def logits_under(layout, arch, hf_dir, tokens, backward):
    ctx = distributed.initialize(layout, arch=arch)
    tokens = tokens.to(distributed.device())
    (model,) = build_gpt_model_chunks(arch, layout)
    load_hf_into_megatron([model], hf_dir, arch)
    logits = gather_vocab(model(tokens, position_ids(tokens), None), arch.vocab_size)
    grads = None
    if backward:
        logits.float().logsumexp(-1).mean().backward()
        grads = [p.grad for p in model.parameters()]
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    return ctx, logits.detach().cpu(), grads  # compared on the host (HF runs there)


@record
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    arch = read_hf_config(a.hf_dir)
    tokens = fixed_tokens(arch.vocab_size)
    _, tp1, _ = logits_under(distributed.ParallelLayout(), arch, a.hf_dir, tokens, backward=False)
    ctx, tp2, grads = logits_under(
        distributed.ParallelLayout(tensor_model_parallel_size=2), arch, a.hf_dir, tokens, True
    )
    sp = distributed.ParallelLayout(tensor_model_parallel_size=2, sequence_parallel=True)
    _, tp2_sp, _ = logits_under(sp, arch, a.hf_dir, tokens, backward=False)
    if ctx.rank == 0:
        torch.save(
            {
                "tokens": tokens,
                "tp1": tp1,
                "tp2": tp2,
                "tp2_sp": tp2_sp,
                "grad_params": sum(g is not None for g in grads),
                "num_params": len(grads),
                "grad_finite": all(bool(torch.isfinite(g).all()) for g in grads if g is not None),
            },
            a.out,
        )
    distributed.destroy()


if __name__ == "__main__":
    main()
    exit_now()  # past the interpreter's teardown of torch, megatron and vLLM
