"""torchrun worker: PP=2 with Megatron's 1F1B schedule, and PP=2 x virtual PP=2 with the
interleaved schedule, give the loss and gradients of PP=1.

Phase "pp1" runs PP=1 (each rank holds the whole model), "pp2" PP=2 (one stage per rank),
"vpp2" PP=2 with two model chunks per rank (layers 0,2 on rank 0; 1,3 on rank 1), all on the
same batch split into the same micro-batches. Each rank writes {phase: {"loss", "grads"}} to
--out-dir/rank{r}.pt, gradients keyed by global layer index so layouts can be compared.
"""

import argparse
from functools import partial
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from megatron_rl.models.gpt import build_gpt_model_chunks, layer_offset
from megatron_rl.models.hf_config import read_hf_config
from megatron_rl.models.hf_mapping import load_hf_into_megatron
from megatron_rl.parallel import distributed
from megatron_rl.procutil import exit_now
from tests.torchrun.common import fixed_tokens, position_ids

MICRO_BATCHES, MICRO_BATCH_SIZE, SEQ = 4, 2, 16


def global_name(name: str, offset: int) -> str:
    parts = name.split(".")
    if name.startswith("decoder.layers."):
        parts[2] = str(int(parts[2]) + offset)
    return ".".join(parts)


def loss_func(mask: torch.Tensor, per_token_loss: torch.Tensor):
    """Mean token cross-entropy of one micro-batch; Megatron averages over micro-batches."""
    loss = (per_token_loss * mask).sum() / mask.sum()
    # Megatron divides the returned loss by num_microbatches in place: a metric that shares
    # its storage (a bare .detach()) would be scaled too, hence the clone.
    return loss, {"loss": loss.detach().clone()}


def forward_step(data_iterator, model):
    tokens = next(data_iterator)
    labels = torch.roll(tokens, -1, dims=1)
    mask = torch.ones_like(tokens, dtype=torch.float32)
    mask[:, -1] = 0  # the last position has no next token
    output = model(tokens, position_ids(tokens), None, labels=labels)
    return output, partial(loss_func, mask)


def run(layout, arch, hf_dir, batch):
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    distributed.initialize(layout, arch=arch)
    batch = batch.to(distributed.device())
    chunks = build_gpt_model_chunks(arch, layout)
    load_hf_into_megatron(chunks, hf_dir, arch)
    # Every chunk's forward step draws from its own iterator over the same micro-batches.
    iterators = [iter(batch.split(MICRO_BATCH_SIZE)) for _ in chunks]
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks,
        num_microbatches=MICRO_BATCHES,
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH_SIZE,
        forward_only=False,
    )
    # Only the last stage computes the loss; the schedule returns [] elsewhere.
    loss = torch.stack([m["loss"] for m in losses]).mean().item() if losses else None
    grads = {
        global_name(n, layer_offset(chunk)): p.grad.clone()
        for chunk in chunks
        for n, p in chunk.named_parameters()
    }
    parallel_state.destroy_model_parallel()
    return {"loss": loss, "grads": grads}


@record
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--out-dir", required=True)
    a = p.parse_args()
    arch = read_hf_config(a.hf_dir)
    batch = fixed_tokens(arch.vocab_size, batch=MICRO_BATCHES * MICRO_BATCH_SIZE, seq=SEQ)
    result = {
        "pp1": run(distributed.ParallelLayout(), arch, a.hf_dir, batch),
        "pp2": run(
            distributed.ParallelLayout(pipeline_model_parallel_size=2), arch, a.hf_dir, batch
        ),
        "vpp2": run(
            distributed.ParallelLayout(
                pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2
            ),
            arch,
            a.hf_dir,
            batch,
        ),
    }
    rank = torch.distributed.get_rank()
    torch.save(result, Path(a.out_dir) / f"rank{rank}.pt")
    distributed.destroy()


if __name__ == "__main__":
    main()
    exit_now()  # past the interpreter's teardown of torch, megatron and vLLM
