"""Rollout stage benchmark: inline scoring vs a Ray reward pool that overlaps generation.

    python -m tools.bench rollout [--model DIR] [--prompts 32 --chunk-size 8 --n 4
        --max-new-tokens 64 --reward-delay-ms 20 --workers 2]

Both arms run in this process, one after the other, on fresh vLLM engines with the same seed
(so they generate the same samples; the script checks it) and the same reward: the math
verifier plus `--reward-delay-ms` of work per sample, standing in for a reward model or a
sandboxed checker. Ray start-up and engine warm-up are outside the timings. One JSON line is
printed and appended to `--out`: wall time of each arm, the ratio, and how much of the
scoring the pipelined arm hid behind generation.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

from megatron_rl.rewards.math_reward import math_reward
from tools.bench_common import record


def delayed_math(prompt: str, response: str, label, delay_ms: float = 0.0) -> float:
    """The math verifier plus `delay_ms` of busy work (a stand-in for a costlier reward)."""
    end = time.perf_counter() + delay_ms / 1000
    while time.perf_counter() < end:
        pass
    return math_reward(response, label)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="HF checkpoint; default: a tiny model made here")
    p.add_argument("--prompts", type=int, default=32, help="rollout size (prompts)")
    p.add_argument("--chunk-size", type=int, default=8)
    p.add_argument("--samples-per-prompt", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--reward-delay-ms", type=float, default=20.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", default="bench/results.jsonl")
    a = p.parse_args(argv)

    from transformers import AutoTokenizer

    from examples.tiny_model import make_tiny_model
    from megatron_rl.data import PromptDataConfig, PromptStream, load_prompts
    from megatron_rl.rewards import PythonRewardConfig, ScoringPoolConfig, make_scoring_pool
    from megatron_rl.rollout.rating import RatingConfig, generate_samples_with_rating
    from megatron_rl.rollout.types import EngineConfig, SamplingConfig
    from megatron_rl.rollout.vllm_engine import VLLMEngine

    work = Path(tempfile.mkdtemp(prefix="bench_rollout-"))
    model = a.model or str(make_tiny_model(work / "tiny-qwen2"))
    data = work / "prompts.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"What is {i} + {i + 1}?", "answer": str(2 * i + 1)}) + "\n"
            for i in range(a.prompts)
        )
    )
    tokenizer = AutoTokenizer.from_pretrained(model)
    dataset = load_prompts(PromptDataConfig(path=str(data)), tokenizer)
    sampling = SamplingConfig(n=a.samples_per_prompt, max_new_tokens=a.max_new_tokens)
    fns = [
        PythonRewardConfig(
            path="tools.bench_rollout:delayed_math", kwargs={"delay_ms": a.reward_delay_ms}
        )
    ]
    config = RatingConfig(chunk_size=a.chunk_size, max_inflight_chunks=2)
    runs = {}
    for arm, workers in (("inline", 0), ("ray_pipelined", a.workers)):
        pool = make_scoring_pool(fns, ScoringPoolConfig(num_workers=workers))
        gc.collect()
        engine = VLLMEngine(model, EngineConfig(seed=0))
        engine.generate([dataset[0].prompt_token_ids], SamplingConfig(max_new_tokens=8))  # warm-up
        t0 = time.perf_counter()
        out = generate_samples_with_rating(
            PromptStream(dataset, seed=0), a.prompts, engine, pool, sampling, tokenizer, config
        )
        runs[arm] = (time.perf_counter() - t0, out)
        pool.close()
        del engine
    same = [(s.sample.token_ids, s.reward) for s in runs["inline"][1].samples] == [
        (s.sample.token_ids, s.reward) for s in runs["ray_pipelined"][1].samples
    ]
    inline_s, inline = runs["inline"]
    piped_s, piped = runs["ray_pipelined"]
    record(
        "rollout",
        {
            "prompts": a.prompts,
            "samples_per_prompt": a.samples_per_prompt,
            "chunk_size": a.chunk_size,
            "max_new_tokens": a.max_new_tokens,
            "reward_delay_ms": a.reward_delay_ms,
            "ray_workers": a.workers,
            "same_samples_and_rewards": same,
            "inline_s": round(inline_s, 3),
            "inline_generate_s": round(inline.metrics["timing/generate_s"], 3),
            "inline_score_s": round(inline.metrics["timing/score_s"], 3),
            "ray_pipelined_s": round(piped_s, 3),
            "ray_generate_s": round(piped.metrics["timing/generate_s"], 3),
            "ray_score_wait_s": round(piped.metrics["timing/score_wait_s"], 3),
            "ratio_pipelined_over_inline": round(piped_s / inline_s, 4),
        },
        a.out,
    )
    if not same:
        raise SystemExit("bench_rollout: the two arms generated different samples")


if __name__ == "__main__":
    main()
