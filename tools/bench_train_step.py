"""Benchmark: the actor's PPO/VAPO update vs a plain Megatron forward-backward, side by side.

    [torchrun --nproc-per-node N] python -m tools.bench_train_step --preset tiny
    torchrun ... -m tools.bench_train_step --preset qwen2-1b --dtype bf16 --seq-length 2048

Both arms use the same model chunks, DDP and optimizer, the same tokens and one optimizer
step each: the baseline is megatron's fused cross-entropy (`labels=`) averaged over response
tokens; ours is `Actor.update` (vocab-parallel log-probs and entropy, clip-higher PPO,
positive-sample NLL, global token normalisation). Arms alternate step by step, so machine
noise hits both; the ratio of median step times is the overhead of our loss machinery.
Prints one JSON line and appends it to --out. On a GPU it also reports model FLOPs
utilisation (MFU) against the device's dense bf16 peak.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from megatron_rl import platform
from megatron_rl.models.architecture import ModelArchitecture
from megatron_rl.models.gpt import PrecisionConfig
from megatron_rl.workers.batch import TrainingBatch
from megatron_rl.workers.losses_config import PolicyLossConfig
from megatron_rl.workers.megatron_model import OptimConfig, run_schedule
from megatron_rl.workers.policy import Actor

PRESETS = {
    # The tiny test model's shape (tools.make_tiny_model defaults).
    "tiny": dict(num_layers=4, hidden_size=128, ffn_hidden_size=352, num_attention_heads=4,
                 num_query_groups=2, vocab_size=500),
    # Qwen2.5-0.5B's shape.
    "qwen2.5-0.5b": dict(num_layers=24, hidden_size=896, ffn_hidden_size=4864,
                         num_attention_heads=14, num_query_groups=2, vocab_size=151936),
    # A ~1.2B Qwen2-shaped model (Qwen2.5-1.5B's width, 20 layers).
    "qwen2-1b": dict(num_layers=20, hidden_size=1536, ffn_hidden_size=8960,
                     num_attention_heads=12, num_query_groups=2, vocab_size=151936),
}  # fmt: skip

DENSE_BF16_PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}


def preset_arch(name: str) -> ModelArchitecture:
    p = PRESETS[name]
    return ModelArchitecture(
        model_type="qwen2",
        head_dim=p["hidden_size"] // p["num_attention_heads"],
        max_position_embeddings=32768,
        rope_theta=1e6,
        norm_epsilon=1e-6,
        qkv_bias=True,
        tie_word_embeddings=False,
        **p,
    )


def model_flops_per_token(arch: ModelArchitecture, seq_length: int) -> float:
    """Training FLOPs per token (3x forward), matmuls only, attention over the full sequence
    (Megatron's convention, as in NVIDIA's published MFU)."""
    h, kv = arch.hidden_size, arch.num_query_groups * arch.head_dim
    q = arch.num_attention_heads * arch.head_dim
    per_layer = 2 * (h * q + 2 * h * kv + q * h + 3 * h * arch.ffn_hidden_size)
    attention = 2 * 2 * seq_length * q
    forward = arch.num_layers * (per_layer + attention) + 2 * h * arch.vocab_size
    return 3.0 * forward


def synthetic_batch(arch, sequences: int, seq_length: int, seed: int = 0) -> TrainingBatch:
    """Random tokens; the first quarter of each sequence is prompt, the rest response."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, arch.vocab_size, (sequences, seq_length), generator=g)
    mask = torch.zeros(sequences, seq_length)
    mask[:, seq_length // 4 :] = 1
    return TrainingBatch(
        input_ids=ids,
        response_mask=mask,
        old_logprobs=-torch.rand(sequences, seq_length, generator=g) * 10,
        advantages=torch.randn(sequences, seq_length, generator=g),
        scores=torch.tensor([1.0, -1.0]).repeat((sequences + 1) // 2)[:sequences],
    )


def to_device(batch: TrainingBatch, device) -> TrainingBatch:
    fields = {k: v.to(device) for k, v in vars(batch).items() if isinstance(v, torch.Tensor)}
    return batch.with_fields(**fields)


def plain_step(actor: Actor, batch: TrainingBatch, num_microbatches: int) -> None:
    """Megatron's own fused cross-entropy over response tokens + the same optimizer step."""

    def loss_fn(mb, per_token_ce):
        mask = mb.response_mask[:, 1:]
        loss = (per_token_ce[:, :-1] * mask).sum() / mask.sum()
        return loss, {"loss": loss.detach().clone()}

    def with_labels(chunk):
        forward = chunk.forward

        def call(input_ids, position_ids, attention_mask):
            labels = torch.roll(input_ids, -1, dims=1)
            return forward(input_ids, position_ids, attention_mask, labels=labels)

        return call

    for chunk in actor.chunks:
        chunk.train()
        chunk.zero_grad_buffer()
    actor.optimizer.zero_grad()
    originals = [c.forward for c in actor.chunks]
    for c in actor.chunks:
        c.forward = with_labels(c)
    try:
        run_schedule(actor.chunks, batch.split(num_microbatches), loss_fn, forward_only=False)
    finally:
        for c, f in zip(actor.chunks, originals, strict=True):
            c.forward = f
    actor.optimizer.step()


def timed(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--num-microbatches", type=int, default=2)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default="bench/results.jsonl")
    a = p.parse_args(argv)

    arch = preset_arch(a.preset)
    layout = platform.ParallelLayout(
        tensor_model_parallel_size=a.tp,
        pipeline_model_parallel_size=a.pp,
        sequence_parallel=a.sequence_parallel,
    )
    ctx = platform.initialize(layout, arch=arch)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    actor = Actor(arch, layout, precision=PrecisionConfig(params_dtype=dtype), optim=OptimConfig())
    sequences = a.micro_batch_size * a.num_microbatches
    batch = to_device(synthetic_batch(arch, sequences, a.seq_length, seed=ctx.dp_rank), ctx.device)
    loss_cfg = PolicyLossConfig(nll_coef=0.1)

    arms = {
        "plain_megatron": lambda: plain_step(actor, batch, a.num_microbatches),
        "ppo_update": lambda: actor.update(batch, loss_cfg, a.num_microbatches),
    }
    times = {k: [] for k in arms}
    for step in range(a.warmup + a.steps):
        for name, fn in arms.items():
            t = timed(fn)
            if step >= a.warmup:
                times[name].append(t)

    tokens = sequences * a.seq_length * ctx.dp_size  # tokens per optimizer step, all ranks
    median = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "bench": "train_step",
        "time": datetime.now(UTC).isoformat(timespec="seconds"),
        "preset": a.preset,
        "params_b": round(_param_count(arch) / 1e9, 3),
        "layout": f"TP{a.tp}PP{a.pp}DP{ctx.dp_size}" + ("SP" if a.sequence_parallel else ""),
        "dtype": a.dtype,
        "seq_length": a.seq_length,
        "tokens_per_step": tokens,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "steps": a.steps,
        "ratio_ppo_over_plain": round(median["ppo_update"] / median["plain_megatron"], 4),
    }
    flops = model_flops_per_token(arch, a.seq_length) * tokens
    peak = _peak_tflops()
    for name, t in median.items():
        result[f"{name}_s"] = round(t, 4)
        result[f"{name}_tokens_per_s"] = round(tokens / t, 1)
        if peak:
            result[f"{name}_mfu"] = round(flops / t / (peak * 1e12 * ctx.world_size), 4)
    if ctx.rank == 0:
        line = json.dumps(result)
        print(line, flush=True)
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as f:
            f.write(line + "\n")
    platform.destroy()


def _param_count(arch: ModelArchitecture) -> int:
    h, q = arch.hidden_size, arch.num_attention_heads * arch.head_dim
    kv = arch.num_query_groups * arch.head_dim
    layer = h * q + 2 * h * kv + q * h + 3 * h * arch.ffn_hidden_size + 2 * h + q + 2 * kv
    return arch.num_layers * layer + 2 * arch.vocab_size * h + h


def _peak_tflops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in DENSE_BF16_PEAK_TFLOPS.items() if k in name), None)


if __name__ == "__main__":
    main()
