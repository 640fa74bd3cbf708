"""Compare a converted megatron checkpoint with its Hugging Face source on fixed tokens.

    python -m checkpoints_convert.verify --hf-dir D --ckpt-dir O [--tp N --pp M --ep E --etp T]
        [--rtol R --atol A]

Actors: logits over the real vocabulary. Critics: the value head's output at every
position against the reward model's `score` applied to its last hidden states (the RM's
own score is the value at the last token). Loads the checkpoint at --tp/--pp, prints one
JSON line with the max absolute and max relative error, and exits 1 when any element is
off by more than atol + rtol * |expected| (torch.testing.assert_close's rule). The defaults
are assert_close's for the outputs' dtype times MODEL_TOLERANCE_SCALE: a whole network's
output carries the rounding of every layer, and TP/PP change the order of its sums.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from checkpoints_convert.common import (
    add_layout_args,
    checked_layout,
    describe,
    launch_self,
    load_megatron_checkpoint,
    read_metadata,
    under_torchrun,
)
from megatron_rl.numerics import Tolerance, compare
from megatron_rl.procutil import exit_now

MODEL_TOLERANCE_SCALE = 10.0
"""Verify's default tolerance = assert_close's default for the dtype times this."""


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hf-dir", type=Path, required=True)
    p.add_argument("--ckpt-dir", type=Path, required=True)
    add_layout_args(p)
    p.add_argument("--rtol", type=float, help="default: for the outputs' dtype (fp32: 1.3e-5)")
    p.add_argument("--atol", type=float, help="default: for the outputs' dtype (fp32: 1e-4)")
    p.add_argument("--outputs", type=Path, help="also save the Megatron outputs here (torch.save)")
    p.add_argument("--work-file", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def fixed_tokens(vocab_size: int, batch: int = 2, seq: int = 32) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))


def worker(args) -> None:
    from megatron.core import tensor_parallel

    from megatron_rl.data.batch import TrainingBatch
    from megatron_rl.parallel import distributed
    from megatron_rl.workers.schedule import run_schedule

    layout, _ = checked_layout(args, read_metadata(args.ckpt_dir)[1])
    ctx = distributed.initialize(layout)
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
    distributed.destroy()


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
    _, world = checked_layout(args, arch)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "megatron.pt"
        launch_self(__spec__.name, argv, world, ["--work-file", str(work)])
        megatron = torch.load(work)
    expected = hf_outputs(args.hf_dir, meta["role"], fixed_tokens(arch.vocab_size))
    if args.outputs:
        torch.save(megatron, args.outputs)
    tol = Tolerance.for_dtype(megatron.dtype, MODEL_TOLERANCE_SCALE).resolve(args.rtol, args.atol)
    result = {
        "role": meta["role"],
        "layout": describe(args),
        "compared": "values" if meta["role"] == "critic" else "logits",
        "shape": list(megatron.shape),
        "dtype": str(megatron.dtype).removeprefix("torch."),
        **compare(megatron, expected, tol).as_dict(),
    }
    print(json.dumps(result))
    if not result["ok"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
    exit_now()  # past the interpreter's teardown of torch, megatron and vLLM
