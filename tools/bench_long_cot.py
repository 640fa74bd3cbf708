"""Benchmark: a long-tailed chain-of-thought batch trained with token-budget micro-batches
(`use_dynamic_bsz`), packed ones (`model.use_remove_padding`) and padded to its longest
response, side by side, and beside them the plain-PyTorch peer padding every row to the
longest (`tools/bench_peer.py`).

    python -m tools.bench long_cot [--preset tiny --rows 32 --median 256 --max-length 2048]

Response lengths are lognormal (median `--median`, sigma `--sigma`), clipped to
`--max-length`, and one response reaches it, as a reasoning model's rollout does when a
sample hits the generation limit. Both arms run `Actor.update` on the same batch with the
same activation memory per micro-batch: the padded arm `--micro-batch-size` rows at the
batch's full length (today's split), the token-budget arm micro-batches of at most as many
padded tokens (`split_micro_batches`), the packed arm micro-batches of at most as many packed
tokens, each its rows back to back. Arms alternate step by step; the result is the ratio of
their tokens/s (real tokens: prompt + response, no padding) and the tokens each computes over
the real ones.
"""

from __future__ import annotations

import argparse
import math

import torch

from megatron_rl.data.batch import TrainingBatch, split_micro_batches
from megatron_rl.models.gpt import PrecisionConfig
from megatron_rl.models.presets import PRESETS, preset_arch
from megatron_rl.parallel import distributed
from megatron_rl.procutil import exit_now
from megatron_rl.workers.losses_config import PolicyLossConfig
from megatron_rl.workers.optimizer import OptimConfig
from megatron_rl.workers.policy import Actor
from megatron_rl.workers.spec import RoleModel
from tools.bench_common import alternate, record
from tools.bench_peer import PEER_PRECISIONS, peer_step


def long_tailed_lengths(
    rows: int, median: int, sigma: float, max_length: int, seed: int = 0
) -> list[int]:
    """Lognormal response lengths (median `median`), clipped to [1, max_length]; the first
    row is at max_length."""
    g = torch.Generator().manual_seed(seed)
    draws = torch.exp(math.log(median) + sigma * torch.randn(rows, generator=g))
    lengths = draws.round().clamp(1, max_length).long().tolist()
    lengths[0] = max_length
    return lengths


def long_cot_batch(vocab_size: int, prompt: int, responses: list[int], seed: int = 0):
    """Right-padded [B, prompt + max(responses)] batch with PPO's fields."""
    g = torch.Generator().manual_seed(seed)
    rows, seq = len(responses), prompt + max(responses)
    mask = torch.zeros(rows, seq)
    for i, r in enumerate(responses):
        mask[i, prompt : prompt + r] = 1
    return TrainingBatch(
        input_ids=torch.randint(0, vocab_size, (rows, seq), generator=g),
        response_mask=mask,
        old_logprobs=-torch.rand(rows, seq, generator=g) * 10,
        advantages=torch.randn(rows, seq, generator=g),
        scores=torch.tensor([1.0, -1.0]).repeat((rows + 1) // 2)[:rows],
    )


def padded_tokens(micro: list[TrainingBatch]) -> int:
    """Tokens the model runs on: rows x length, or a packed row's length."""
    return sum(m.model_input_ids.numel() for m in micro)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--prompt-length", type=int, default=64)
    p.add_argument("--median", type=int, default=256)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, default=2, help="rows of the padded arm")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument(
        "--peer",
        choices=[*PEER_PRECISIONS, "none"],
        help="also the plain-PyTorch peer (tools/bench_peer.py), padding every row to the "
        "longest as a user of it does, in this precision (default: fp32 on CPU, mixed on GPU)",
    )
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--out", default="bench/results.jsonl")
    a = p.parse_args(argv)
    if a.peer is None:
        a.peer = "mixed" if torch.cuda.is_available() else "fp32"

    arch = preset_arch(a.preset)
    layout = distributed.ParallelLayout()
    ctx = distributed.initialize(layout, arch=arch)
    precision = PrecisionConfig(params_dtype=torch.bfloat16 if a.dtype == "bf16" else torch.float32)
    actor = Actor(RoleModel(arch, layout, precision=precision), optim=OptimConfig())
    responses = long_tailed_lengths(a.rows, a.median, a.sigma, a.max_length)
    batch = long_cot_batch(arch.vocab_size, a.prompt_length, responses).to(ctx.device)
    budget = a.micro_batch_size * batch.seq_length  # the padded arm's tokens per micro-batch
    nmb = a.rows // a.micro_batch_size
    cfg = PolicyLossConfig(nll_coef=0.1)

    def update(pack: bool, **split):
        actor.use_remove_padding = pack
        return actor.update(batch, cfg, **split)

    arms = {
        "padded": lambda: update(False, num_microbatches=nmb),
        "token_budget": lambda: update(False, max_tokens=budget),
        "packed": lambda: update(True, max_tokens=budget),
    }
    if a.peer != "none":
        arms["peer_padded"] = peer_step(a.preset, a.peer, batch, nmb)
    median = alternate(arms, a.steps, a.warmup)
    real = int(batch.sequence_lengths().sum())
    splits = {
        "padded": split_micro_batches(batch, nmb)[0],
        "token_budget": split_micro_batches(batch, max_tokens=budget)[0],
        "packed": split_micro_batches(batch, max_tokens=budget, pack=True)[0],
        "peer_padded": split_micro_batches(batch, nmb)[0],
    }
    result = {
        "preset": a.preset,
        "rows": a.rows,
        "response_median": a.median,
        "response_max": a.max_length,
        "response_mean": round(sum(responses) / len(responses), 1),
        "max_tokens_per_micro_batch": budget,
        "real_tokens": real,
        "steps": a.steps,
    }
    result["peer"] = a.peer
    for name, t in median.items():
        result[f"{name}_micro_batches"] = len(splits[name])
        result[f"{name}_padded_tokens"] = padded_tokens(splits[name])
        result[f"{name}_s"] = round(t, 3)
        result[f"{name}_tokens_per_s"] = round(real / t, 1)
    result["speedup_token_budget_over_padded"] = round(median["padded"] / median["token_budget"], 3)
    result["speedup_packed_over_padded"] = round(median["padded"] / median["packed"], 3)
    if "peer_padded" in median:
        result["speedup_packed_over_peer"] = round(median["peer_padded"] / median["packed"], 3)
    for name in median:  # the tokens each arm computes over the real ones (1.0: no padding)
        result[f"{name}_tokens_over_real"] = round(padded_tokens(splits[name]) / real, 3)
    if ctx.rank == 0:
        record("long_cot", result, a.out)
    distributed.destroy()


if __name__ == "__main__":
    main()
    exit_now()  # past the interpreter's teardown of torch, megatron and vLLM
