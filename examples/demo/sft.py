"""Supervised warm start: teach the policy the answer format before RL (the tiny demo).

    python -m examples.demo.sft --model DIR --data train.jsonl --out DIR2 [--steps 200
        --lr 1e-3 --batch-size 16 --response-template 'The answer is \\boxed{{{answer}}}.'
        --label-key answer]

Gold responses are the template filled with each row's `--label-key` column, closed by the
tokenizer's EOS (`--label-key solution --response-template '{answer}'`: the column is the
whole worked response). A tool's answer in a response (`<tool_response>...</tool_response>`,
the demo's tool task) is context, out of the loss, as in RL.
The loss is the actor's positive-sample NLL with every sample positive and zero advantages,
i.e. the token-mean NLL of the responses (prompt tokens excluded). One process (world size 1,
TP=1); the result is an HF checkpoint (weights + the input's config and tokenizer), written
to a temporary directory and renamed.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from megatron_rl.data import PromptDataConfig, PromptSampler, load_prompts
from megatron_rl.data.batch import samples_to_batch
from megatron_rl.fsutil import atomic_output_dir
from megatron_rl.models.hf_config import read_hf_config
from megatron_rl.models.hf_mapping import export_hf_tensors
from megatron_rl.parallel import distributed
from megatron_rl.rollout.types import Sample
from megatron_rl.workers.losses_config import PolicyLossConfig
from megatron_rl.workers.optimizer import OptimConfig
from megatron_rl.workers.policy import Actor
from megatron_rl.workers.spec import RoleModel

TOOL_RESPONSE = ("<tool_response>", "</tool_response>")
"""A tool's answer in a gold response (the `code` format's block): context, not imitated."""


def gold_response(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """A gold response's ids, closed by EOS, and the spans of the tool answers in it: each
    stretch encoded alone, as a multi-turn rollout appends it (`rollout/agent.py`), and each
    answer out of the loss, as the environment's tokens are in RL (`samples_to_batch`)."""
    ids, spans, rest = [], [], text
    while TOOL_RESPONSE[0] in rest:
        before, _, after = rest.partition(TOOL_RESPONSE[0])
        answer, _, rest = after.partition(TOOL_RESPONSE[1])
        ids += tokenizer(before, add_special_tokens=False)["input_ids"]
        block = tokenizer(TOOL_RESPONSE[0] + answer + TOOL_RESPONSE[1], add_special_tokens=False)
        spans.append((len(ids), len(ids) + len(block["input_ids"])))
        ids += block["input_ids"]
    ids += tokenizer(rest, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return ids, spans


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--response-template", default="The answer is \\boxed{{{answer}}}.")
    p.add_argument("--label-key", default="answer", help="the column the template fills in")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (fixed on purpose)")
    a = p.parse_args(argv)

    # why: transformers takes seconds to import: only this path needs it
    from transformers import AutoTokenizer

    arch = read_hf_config(a.model)
    layout = distributed.ParallelLayout()
    distributed.pin_threads(a.threads)
    distributed.initialize(layout, arch=arch, seed=a.seed, deterministic=True)
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    dataset = load_prompts(PromptDataConfig(path=a.data, label_key=a.label_key), tokenizer)
    actor = Actor(
        RoleModel(arch, layout, model_path=a.model), optim=OptimConfig(lr=a.lr, weight_decay=0.0)
    )
    loss = PolicyLossConfig(nll_coef=1.0)
    sampler = PromptSampler(len(dataset), seed=a.seed)
    for step in range(a.steps):
        rows = [dataset[i] for i in sampler.take(a.batch_size)]
        samples = []
        for r in rows:
            ids, spans = gold_response(tokenizer, a.response_template.format(answer=r.label))
            samples.append(
                Sample(0, 0, r.prompt_token_ids, ids, [0.0] * len(ids), "stop", env_spans=spans)
            )
        batch = samples_to_batch(samples, tokenizer.pad_token_id or 0)
        zeros = torch.zeros(batch.input_ids.shape, device="cpu")
        batch = batch.with_fields(  # in host memory: the actor moves it to its device
            old_logprobs=zeros, advantages=zeros, scores=torch.ones(len(batch), device="cpu")
        )
        metrics = actor.update(batch, loss)
        if step % 20 == 0 or step == a.steps - 1:
            print(f"sft step {step + 1}/{a.steps} nll {metrics['nll_loss']:.4f}", flush=True)

    out = Path(a.out)
    with atomic_output_dir(out, overwrite=True) as tmp:
        tensors = {name: t.contiguous() for name, t in export_hf_tensors(actor.chunks, arch)}
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        for f in Path(a.model).iterdir():
            if (
                f.suffix != ".safetensors"
                and f.name != "model.safetensors.index.json"
                and f.is_file()
            ):
                shutil.copy(f, tmp / f.name)
    distributed.destroy()
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
