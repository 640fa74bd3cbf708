"""`make demo`: the smoke run of the stack, end to end on the tiny model.

1. build the tiny Qwen2 checkpoint (HF format) if it is not there yet;
2. one Megatron forward/backward with TP=2 under torchrun (2 CPU processes, gloo), its loss
   checked against Hugging Face transformers on the same batch;
3. one vLLM generation: group sampling (n samples per prompt) with per-token log-probs.

The trainer issue replaces this with the tiny VAPO run; the checks here stay as its preamble.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

DEFAULT_DIR = Path("runs/demo")


def ensure_tiny_model(path: Path) -> Path:
    from tools.make_tiny_model import make_tiny_model

    if (path / "config.json").exists():
        return path
    return make_tiny_model(path)


def megatron_step(model_dir: Path) -> dict:
    from megatron_rl.launch import run_torchrun

    result = run_torchrun(
        "megatron_rl.demo_tp_step", ["--hf-dir", str(model_dir), "--tp", "2"], timeout=600
    )
    lines = [ln for ln in result.output.splitlines() if ln.startswith('{"layout"')]
    if len(lines) != 1:
        raise RuntimeError(f"the TP=2 step printed no result line; output:\n{result.output}")
    return json.loads(lines[0])


def hf_reference_loss(model_dir: Path) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_rl.demo_tp_step import demo_batch, next_token_loss

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokens = demo_batch(model.config.vocab_size)
    with torch.no_grad():
        return next_token_loss(model(tokens).logits, tokens).item()


def vllm_generation(model_dir: Path, n: int) -> dict:
    from transformers import AutoTokenizer

    from megatron_rl.rollout.vllm_engine import EngineConfig, SamplingConfig, VLLMEngine

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    questions = ["What is 12 + 30?", "What is 7 * 6?"]
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)[
            "input_ids"
        ]
        for q in questions
    ]
    sampling = SamplingConfig(n=n, max_new_tokens=32)
    t0 = time.perf_counter()
    engine = VLLMEngine(model_dir, EngineConfig(seed=0, max_model_len=512))
    t1 = time.perf_counter()
    engine.generate(prompts, sampling)  # the first call pays one-off kernel warm-up
    t2 = time.perf_counter()
    samples = engine.generate(prompts, sampling)
    t3 = time.perf_counter()
    tokens = sum(s.response_length for s in samples)
    return {
        "engine_start_s": round(t1 - t0, 2),
        "first_generate_s": round(t2 - t1, 2),
        "prompts": len(prompts),
        "samples": len(samples),
        "generated_tokens": tokens,
        "tokens_per_s": round(tokens / (t3 - t2), 1),
        "mean_logprob": round(sum(sum(s.logprobs) for s in samples) / tokens, 4),
        "first_sample": {
            "prompt_index": samples[0].prompt_index,
            "finish_reason": samples[0].finish_reason,
            "text": tokenizer.decode(samples[0].token_ids)[:80],
        },
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Smoke run: tiny model, Megatron TP=2 step, vLLM.")
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    a = p.parse_args(argv)

    model_dir = ensure_tiny_model(a.dir / "tiny-qwen2")
    print(f"[1/3] tiny Qwen2 checkpoint: {model_dir}")

    step = megatron_step(model_dir)
    ref = hf_reference_loss(model_dir)
    step["hf_loss"] = round(ref, 6)
    step["abs_diff_vs_hf"] = abs(step["loss"] - ref)
    print("[2/3] Megatron TP=2 forward/backward:", json.dumps(step))
    if step["abs_diff_vs_hf"] > 1e-4 or not step["grads_finite"]:
        raise SystemExit(
            "Megatron TP=2 loss disagrees with Hugging Face, or gradients are not finite"
        )

    gen = vllm_generation(model_dir, a.n)
    print("[3/3] vLLM generation:", json.dumps(gen))
    if gen["samples"] != gen["prompts"] * a.n:
        raise SystemExit(f"expected {gen['prompts'] * a.n} samples, got {gen['samples']}")
    print("smoke run OK")


if __name__ == "__main__":
    main()
