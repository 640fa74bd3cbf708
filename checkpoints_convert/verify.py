"""Compare a converted megatron checkpoint with its Hugging Face source on fixed tokens.

    python -m checkpoints_convert.verify --hf-dir D --ckpt-dir O [--tp N --pp M] [--atol 1e-5]

Actors: logits over the real vocabulary. Critics: the value head's output at every
position against the reward model's `score` applied to its last hidden states (the RM's
own score is the value at the last token). Loads the checkpoint at --tp/--pp, prints one
JSON line, exits 1 when the largest difference exceeds --atol.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from checkpoints_convert.common import (
    checked_layout,
    launch_self,
    load_megatron_checkpoint,
    read_metadata,
    under_torchrun,
)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hf-dir", type=Path, required=True)
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--atol", type=float, default=1e-5)
    p.add_argument("--outputs", type=Path, help="also save the Megatron outputs here (torch.save)")
    p.add_argument("--work-file", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def fixed_tokens(vocab_size: int, batch: int = 2, seq: int = 32) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))


def worker(args) -> None:
    from megatron.core import tensor_parallel

    from megatron_rl import platform
    from megatron_rl.workers.batch import TrainingBatch
    from megatron_rl.workers.megatron_model import run_schedule

    layout = checked_layout(args.tp, args.pp)
    ctx = platform.initialize(layout)
    chunks, arch, meta = load_megatron_checkpoint(args.ckpt_dir, layout)
    for c in chunks:
        c.eval()
    ids = fixed_tokens(arch.vocab_size)
    batch = TrainingBatch(input_ids=ids, response_mask=torch.zeros_like(ids, dtype=torch.float))

    def collect(mb, out):
        if meta["role"] == "critic":
            return out[..., 0]
        return tensor_parallel.gather_from_tensor_model_parallel_region(out)[..., : arch.vocab_size]

    with torch.no_grad():
        parts = run_schedule(chunks, [batch], collect, forward_only=True, collect_outputs=True)
    if ctx.is_last_pp_stage and ctx.tp_rank == 0 and ctx.dp_rank == 0:
        torch.save(torch.cat(parts), args.work_file)
    platform.destroy()


def hf_outputs(hf_dir: Path, role: str, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    with torch.no_grad():
        if role == "critic":
            rm = AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=torch.float32)
            return rm.score(rm.model(ids).last_hidden_state)[..., 0]
        lm = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        return lm(ids).logits


def main(argv: list[str] | None = None) -> None:
    import tempfile

    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if under_torchrun():
        return record(worker)(args)
    meta, arch = read_metadata(args.ckpt_dir)
    checked_layout(args.tp, args.pp, arch)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "megatron.pt"
        launch_self(__spec__.name, argv, args.tp * args.pp, ["--work-file", str(work)])
        megatron = torch.load(work)
    expected = hf_outputs(args.hf_dir, meta["role"], fixed_tokens(arch.vocab_size))
    if args.outputs:
        torch.save(megatron, args.outputs)
    diff = (megatron - expected).abs().max().item()
    result = {
        "role": meta["role"],
        "layout": f"TP{args.tp}PP{args.pp}",
        "compared": "values" if meta["role"] == "critic" else "logits",
        "shape": list(megatron.shape),
        "max_abs_diff": diff,
        "max_abs_value": expected.abs().max().item(),
        "atol": args.atol,
        "ok": diff <= args.atol,
    }
    print(json.dumps(result))
    if not result["ok"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
