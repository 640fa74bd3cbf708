"""torchrun worker (2 ranks): chunked log-probs and entropy from hidden states
(`parallel.vocab.chunked_logprobs_entropy`) equal those of the full vocab-parallel logits, in
value and in the gradients of the hidden states and the projection, at TP2 and TP1 (DP2),
with a padded vocabulary, a temperature, tiles of 1 or 7 tokens over all of a rank's rows,
blocks of 50 rows (the last one shorter) or of one row, and one tile of everything, and with
the entropy in the loss, out of it, or not calculated (`calculate_entropy=False`: None);
backward recomputing the logits, or from the probabilities forward kept (`keep_probs`).

Each rank writes {layout}_{rank}.pt: {case: {"chunked": {...}, "full": {...}}} with
logprobs, entropy, grad_hidden, grad_weight.
"""

import argparse
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from megatron_rl.parallel import distributed
from megatron_rl.parallel.vocab import (
    chunked_logprobs_entropy,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
)
from megatron_rl.procutil import exit_now

VOCAB, PADDED, HIDDEN, TOKENS = 250, 256, 32, (3, 10)
CASES = {  # name: ((tokens, vocabulary rows) of a tile, temperature, the entropy, kept)
    "one_token_tiles": ((1, PADDED), 1.0, "in_loss", False),
    "tiles_of_7_by_50_tempered": ((7, 50), 0.7, "in_loss", False),
    "one_row_blocks": ((30, 1), 1.0, "in_loss", False),
    "one_tile_no_entropy_grad": (None, 1.3, "not_in_loss", False),
    "log_probs_alone_tiles_of_7_by_50": ((7, 50), 0.7, "not_calculated", False),
    "kept_tiles_of_7_by_50_tempered": ((7, 50), 0.7, "in_loss", True),
    "kept_one_tile_no_entropy_grad": (None, 1.3, "not_in_loss", True),
}
LAYOUTS = {
    "tp2": distributed.ParallelLayout(tensor_model_parallel_size=2),
    "tp1": distributed.ParallelLayout(),
}


def run(case, hidden, weight, labels, coef_lp, coef_h, chunked: bool):
    tile, temperature, how, keep_probs = CASES[case]
    hidden = hidden.clone().requires_grad_(True)
    weight = weight.clone().requires_grad_(True)
    if chunked:
        logprobs, entropy = chunked_logprobs_entropy(
            hidden, weight, labels, VOCAB, temperature, tile, how != "not_calculated", keep_probs
        )
    else:
        logits = hidden @ weight.t()
        logprobs = vocab_parallel_logprobs(logits, labels, VOCAB, temperature)
        entropy = vocab_parallel_entropy(logits, VOCAB, temperature)
    loss = (coef_lp * logprobs).sum()
    if how == "in_loss":
        loss = loss + (coef_h * entropy).sum()
    loss.backward()
    return {
        "logprobs": logprobs.detach(),
        "entropy": None if entropy is None else entropy.detach(),
        "grad_hidden": hidden.grad,
        "grad_weight": weight.grad,
    }


@record
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out-dir", required=True)
    a = p.parse_args()
    for name, layout in LAYOUTS.items():
        ctx = distributed.initialize(layout)
        g = torch.Generator().manual_seed(3)  # the same on every rank
        hidden = torch.randn(*TOKENS, HIDDEN, generator=g).to(ctx.device)
        full_weight = (torch.randn(PADDED, HIDDEN, generator=g) * 0.5).to(ctx.device)
        labels = torch.randint(0, VOCAB, TOKENS, generator=g).to(ctx.device)
        coef_lp, coef_h = (torch.randn(*TOKENS, generator=g).to(ctx.device) for _ in range(2))
        tp = layout.tensor_model_parallel_size
        weight = full_weight.chunk(tp)[ctx.rank % tp]
        out = {
            case: {
                kind: run(case, hidden, weight, labels, coef_lp, coef_h, kind == "chunked")
                for kind in ("chunked", "full")
            }
            for case in CASES
        }
        torch.save(out, Path(a.out_dir) / f"{name}_{ctx.rank}.pt")
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    distributed.destroy()


if __name__ == "__main__":
    main()
    exit_now()  # past the interpreter's teardown of torch, megatron and vLLM
