"""torchrun worker (2 ranks): the local spec's fused core attention (`SDPAttention`) gives the
unfused reference's (`DotProductAttention`) logits and gradients, with the same weights, at
TP2 with sequence parallelism, PP2 (1F1B over two micro-batches) and TP1 over DP2; so do its
packed micro-batches (rows back to back, each attending within itself). The tiny preset has
grouped-query attention (4 query heads, 2 key/value groups; 2 and 1 a TP rank). The same
chunks again with megatron-core's own layer forward in place of `models/layer.py`'s
(`*_megatron_layer`), and with both in eval mode without gradients (`*_eval`, where the
residual sums run in place).

Each rank writes {layout}_{rank}.pt: {"logits": {arm: [real tokens, V/tp] per micro-batch,
last stage only}, "grads": {arm: {name: grad}}}, arms unfused, sdpa, sdpa_packed,
sdpa_megatron_layer, sdpa_packed_megatron_layer (both logits and gradients), sdpa_eval and
sdpa_eval_megatron_layer (logits).
"""

import argparse
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from megatron_rl.data.batch import TrainingBatch
from megatron_rl.models.gpt import build_gpt_model_chunks
from megatron_rl.models.presets import preset_arch
from megatron_rl.parallel import distributed
from megatron_rl.procutil import exit_now
from megatron_rl.workers.schedule import run_schedule
from tests.torchrun.common import fixed_tokens
from tools.bench_train_step import megatron_own

LAYOUTS = {
    "tp2_sp": distributed.ParallelLayout(tensor_model_parallel_size=2, sequence_parallel=True),
    "pp2": distributed.ParallelLayout(pipeline_model_parallel_size=2),
    "dp2": distributed.ParallelLayout(),
}


LENGTHS = (96, 50, 73, 21)
"""Row lengths of the packed case (the rest of each row is padding)."""


def micro_batches(tokens) -> list[TrainingBatch]:
    """Two micro-batches of two rows, each row's first `LENGTHS` tokens real."""
    lengths = torch.tensor(LENGTHS, device=tokens.device)
    real = torch.arange(tokens.shape[1], device=tokens.device) < lengths[:, None]
    return [
        TrainingBatch(input_ids=t, response_mask=m.float())
        for t, m in zip(tokens.split(2), real.split(2), strict=True)
    ]


def eval_logits(chunks, tokens):
    """The real tokens' logits of a forward-only pass in eval mode, without gradients."""
    micro = micro_batches(tokens)
    for chunk in chunks:
        chunk.eval()
    try:
        with torch.no_grad():
            out = run_schedule(
                chunks,
                micro,
                lambda mb, logits: logits[mb.response_mask.bool()].clone(),
                forward_only=True,
                collect_outputs=True,
            )
    finally:
        for chunk in chunks:
            chunk.train()
    return out


def logits_and_grads(chunks, tokens, packed: bool = False, multiple: int = 1):
    """Two micro-batches through megatron's schedule, a loss reading every real token's
    logits; the logits of the real tokens, rows one after another, and every gradient.
    `packed`: each micro-batch's rows of `LENGTHS` back to back (`data/packing.py`)."""
    micro = micro_batches(tokens)
    if packed:
        micro = [mb.with_length(int(mb.sequence_lengths().max())).packed(multiple) for mb in micro]
    seen = []

    def loss_fn(mb, logits):
        if mb.packing is not None:
            logits = logits[0, : int(mb.sequence_lengths().sum())]
        else:
            logits = logits[mb.response_mask.bool()]
        seen.append(logits.detach().clone())
        loss = logits.float().logsumexp(-1).sum() / 100
        return loss, {"loss": loss.detach().clone()}

    for chunk in chunks:
        chunk.zero_grad()
    run_schedule(chunks, micro, loss_fn, forward_only=False)
    # sequence-parallel norms: each rank's gradient covers its slice of the sequence (which
    # packing moves); summed over TP, as megatron's DDP does before a step
    from megatron.core import parallel_state

    for chunk in chunks:
        for p in chunk.parameters():
            if getattr(p, "sequence_parallel", False):
                group = parallel_state.get_tensor_model_parallel_group()
                torch.distributed.all_reduce(p.grad, group=group)
    grads = {
        f"{i}.{name}": p.grad.clone()
        for i, chunk in enumerate(chunks)
        for name, p in chunk.named_parameters()
    }
    return seen, grads


def packed_and_eval(out: dict, suffix: str, chunks, tokens, multiple: int) -> None:
    """`chunks`' packed arm (logits and gradients) and eval arm (logits) into `out`, named
    sdpa_packed{suffix} and sdpa_eval{suffix}."""
    arm = f"sdpa_packed{suffix}"
    out["logits"][arm], out["grads"][arm] = logits_and_grads(
        chunks, tokens, packed=True, multiple=multiple
    )
    out["logits"][f"sdpa_eval{suffix}"] = eval_logits(chunks, tokens)


@record
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out-dir", required=True)
    p.add_argument("--seq-length", type=int, default=96)
    a = p.parse_args()
    arch = preset_arch("tiny")
    for name, layout in LAYOUTS.items():
        ctx = distributed.initialize(layout, arch=arch)
        tokens = fixed_tokens(arch.vocab_size, batch=4, seq=a.seq_length).to(ctx.device)
        reference = build_gpt_model_chunks(arch, layout, core_attention="unfused")
        fused = build_gpt_model_chunks(arch, layout, core_attention="sdpa")
        for r, f in zip(reference, fused, strict=True):
            f.load_state_dict(r.state_dict())
        out = {"logits": {}, "grads": {}}
        for attention, chunks in (("unfused", reference), ("sdpa", fused)):
            out["logits"][attention], out["grads"][attention] = logits_and_grads(chunks, tokens)
        multiple = 2 if layout.sequence_parallel else 1
        packed_and_eval(out, "", fused, tokens, multiple)
        with megatron_own("layer"):  # the same chunks with megatron-core's layer forward
            arm = "sdpa_megatron_layer"
            out["logits"][arm], out["grads"][arm] = logits_and_grads(fused, tokens)
            packed_and_eval(out, "_megatron_layer", fused, tokens, multiple)
        # which layers took our forward (decided at their first call)
        out["lean_layers"] = [
            layer.__dict__.get("_lean_forward") for chunk in fused for layer in chunk.decoder.layers
        ]
        torch.save(out, Path(a.out_dir) / f"{name}_{ctx.rank}.pt")
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    distributed.destroy()


if __name__ == "__main__":
    main()
    exit_now()  # past the interpreter's teardown of torch, megatron and vLLM
