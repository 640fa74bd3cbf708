"""Benchmark: rollout generation with vLLM (our `VLLMEngine`) vs Hugging Face `generate`.

    python -m tools.bench generate [--preset qwen2.5-0.5b --prompts 8 --n 4 --max-new-tokens 32]

Both arms sample `n` responses per prompt at temperature 1 from the same checkpoint (a
random one of the preset's shape, or --model), in this process, alternately: vLLM through
`VLLMEngine.generate` (continuous batching, paged KV cache), HF as one left-padded batch
with `num_return_sequences=n`. Both generate exactly max_new_tokens per sample
(`ignore_eos` / `min_new_tokens`), so they do the same work; prints generated tokens/s of
each and their ratio (one JSON line, appended to --out).
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
from pathlib import Path

import torch

from megatron_rl.models.presets import PRESETS
from megatron_rl.procutil import exit_now
from megatron_rl.rollout.types import EngineConfig, SamplingConfig
from megatron_rl.rollout.vllm_engine import VLLMEngine
from tools.bench_common import alternate, record


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen2.5-0.5b")
    p.add_argument("--model", help="an HF checkpoint instead of a random preset-shaped one")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--prompt-length", type=int, default=32, help="mean; +-50%% per prompt")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default="bench/results.jsonl")
    a = p.parse_args(argv)

    from transformers import AutoModelForCausalLM

    work = Path(tempfile.mkdtemp(prefix="bench_generate-"))
    try:
        model_dir = a.model
        if model_dir is None:
            from examples.tiny_model import make_tiny_model, spec_for_preset

            model_dir = make_tiny_model(work / "model", spec_for_preset(a.preset))
        on_gpu = torch.cuda.is_available()
        dtype = torch.bfloat16 if on_gpu else torch.float32
        engine = VLLMEngine(model_dir, EngineConfig(dtype=str(dtype).removeprefix("torch.")))
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        hf = hf.to("cuda" if on_gpu else "cpu").eval()

        rng = random.Random(0)
        low, high = max(1, a.prompt_length // 2), a.prompt_length * 3 // 2
        prompts = [
            [rng.randrange(3, 300) for _ in range(rng.randint(low, high))] for _ in range(a.prompts)
        ]
        sampling = SamplingConfig(n=a.n, max_new_tokens=a.max_new_tokens, ignore_eos=True)
        generated = {}

        def vllm_arm():
            samples = engine.generate(prompts, sampling)
            generated["vllm"] = sum(s.response_length for s in samples)

        def hf_arm():
            generated["hf"] = hf_generate(hf, prompts, a.n, a.max_new_tokens)

        seconds = alternate({"vllm": vllm_arm, "hf": hf_arm}, a.steps)
        engine.shutdown()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tokens_per_s = {arm: generated[arm] / s for arm, s in seconds.items()}
    record(
        "generate",
        {
            "model": a.model or a.preset,
            "prompts": a.prompts,
            "samples_per_prompt": a.n,
            "max_new_tokens": a.max_new_tokens,
            "dtype": str(dtype).removeprefix("torch."),
            "generated_tokens": generated,
            "steps": a.steps,
            **{f"{arm}_s": round(s, 3) for arm, s in seconds.items()},
            **{f"{arm}_tokens_per_s": round(t, 1) for arm, t in tokens_per_s.items()},
            "ratio_vllm_over_hf_tokens_per_s": round(tokens_per_s["vllm"] / tokens_per_s["hf"], 3),
        },
        a.out,
    )


@torch.no_grad()
def hf_generate(model, prompts: list[list[int]], n: int, max_new_tokens: int) -> int:
    """Sample n responses per prompt in one left-padded batch; returns tokens generated."""
    width = max(map(len, prompts))
    pad = model.config.pad_token_id or 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor(
        [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device
    )
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        num_return_sequences=n,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        pad_token_id=pad,
    )
    return (out.shape[1] - width) * out.shape[0]


if __name__ == "__main__":
    main()
    exit_now()  # past the interpreter's teardown of torch, megatron and vLLM
