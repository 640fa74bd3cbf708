"""torchrun worker (2 ranks): for each Hugging Face checkpoint given, Megatron's logits at
TP=1, TP=2 and TP=2 with sequence parallelism, and the HF tensors exported back from the TP=2
model (shards gathered, as the weight sync and the converter do).

Writes --out-dir/{name}.pt (rank 0) with {"tokens", "tp1", "tp2", "tp2_sp", "exported"}.
"""

import argparse
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from megatron_rl.models.gpt import build_gpt_model_chunks
from megatron_rl.models.hf_config import read_hf_config
from megatron_rl.models.hf_mapping import export_hf_tensors, load_hf_into_megatron
from megatron_rl.parallel import distributed
from tests.torchrun.common import fixed_tokens, gather_vocab, position_ids


def run_layout(layout, arch, hf_dir, tokens, export=False):
    ctx = distributed.initialize(layout, arch=arch)
    (model,) = build_gpt_model_chunks(arch, layout)
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
    tp2 = distributed.ParallelLayout(tensor_model_parallel_size=2)
    sp = distributed.ParallelLayout(tensor_model_parallel_size=2, sequence_parallel=True)
    for hf_dir in a.hf_dirs:
        arch = read_hf_config(hf_dir)
        tokens = fixed_tokens(arch.vocab_size, seq=a.seq)
        _, tp1_logits, _ = run_layout(distributed.ParallelLayout(), arch, hf_dir, tokens)
        ctx, tp2_logits, exported = run_layout(tp2, arch, hf_dir, tokens, export=True)
        _, sp_logits, _ = run_layout(sp, arch, hf_dir, tokens)
        if ctx.rank == 0:
            result = dict(
                tokens=tokens, tp1=tp1_logits, tp2=tp2_logits, tp2_sp=sp_logits, exported=exported
            )
            torch.save(result, Path(a.out_dir) / f"{Path(hf_dir).name}.pt")
    distributed.destroy()


if __name__ == "__main__":
    main()
