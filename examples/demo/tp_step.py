"""torchrun worker of the smoke demo: one Megatron forward/backward of the tiny model.

    torchrun --nproc-per-node 2 -m examples.demo.tp_step --hf-dir DIR [--tp 2 --pp 1]

Loads the HF checkpoint into a Megatron GPTModel under the given layout, computes the
next-token cross-entropy of a fixed batch (logits gathered over TP and cut to the real
vocabulary, so it is comparable with Hugging Face), backpropagates, and prints one JSON line
from global rank 0: loss, gradient norm, parameter count, timings.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from megatron_rl.models.gpt import build_gpt_model_chunks
from megatron_rl.models.hf_config import read_hf_config
from megatron_rl.models.hf_mapping import load_hf_into_megatron
from megatron_rl.parallel import distributed


def demo_batch(vocab_size: int, batch: int = 4, seq: int = 32, seed: int = 0) -> torch.Tensor:
    """[batch, seq] token ids, the same on every rank and in the HF reference."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq), generator=g, device="cpu")


def next_token_loss(logits_bsv: torch.Tensor, tokens_bs: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting tokens[:, 1:] from logits[:, :-1]."""
    v = logits_bsv.shape[-1]
    return torch.nn.functional.cross_entropy(
        logits_bsv[:, :-1].reshape(-1, v).float(), tokens_bs[:, 1:].reshape(-1)
    )


@record
def main() -> None:
    # why: megatron-core takes seconds to import: loaded on first use
    from megatron.core import tensor_parallel

    p = argparse.ArgumentParser()
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--tp", type=int, default=2)
    a = p.parse_args()
    arch = read_hf_config(a.hf_dir)
    layout = distributed.ParallelLayout(tensor_model_parallel_size=a.tp)
    ctx = distributed.initialize(layout, arch=arch)
    (model,) = build_gpt_model_chunks(arch, layout)
    load_hf_into_megatron([model], a.hf_dir, arch)

    tokens = demo_batch(arch.vocab_size).to(ctx.device)
    positions = torch.arange(tokens.shape[1], device=ctx.device).expand_as(tokens)
    t0 = time.perf_counter()
    logits = model(tokens, positions, None)
    full = tensor_parallel.gather_from_tensor_model_parallel_region(logits)[..., : arch.vocab_size]
    loss = next_token_loss(full, tokens)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()

    grads = [p.grad for p in model.parameters()]
    grad_norm = model_parallel_grad_norm(model)
    if ctx.rank == 0:
        print(
            json.dumps(
                {
                    "layout": f"TP={a.tp}",
                    "world_size": ctx.world_size,
                    "backend": ctx.backend,
                    "cpu_compat": ctx.cpu_compat,
                    "loss": round(loss.item(), 6),
                    "grad_norm": round(grad_norm, 6),
                    "grads_finite": all(bool(torch.isfinite(g).all()) for g in grads),
                    "params_per_rank": sum(p.numel() for p in model.parameters()),
                    "forward_s": round(t1 - t0, 3),
                    "backward_s": round(t2 - t1, 3),
                }
            ),
            flush=True,
        )
    distributed.destroy()


def model_parallel_grad_norm(model) -> float:
    """L2 norm of the full model's gradient, each TP-replicated parameter counted once."""
    # why: megatron-core takes seconds to import: loaded on first use
    from megatron.core import parallel_state

    # why: megatron-core takes seconds to import: loaded on first use
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    sq = sum(
        p.grad.float().pow(2).sum()
        for p in model.parameters()
        if param_is_not_tensor_parallel_duplicate(p)
    )
    torch.distributed.all_reduce(sq, group=parallel_state.get_model_parallel_group())
    return sq.sqrt().item()


if __name__ == "__main__":
    main()
