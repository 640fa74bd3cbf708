"""Log-prob parity check: vLLM's log-probs for tokens it sampled vs the Megatron actor's.

    python -m tools.logprob_diff --hf-dir D [--tp 2 --pp 1 --vllm-tp 1 --prompts 8 --samples-per-prompt 4]
        [--temperature 0.7 --top-p 1.0 --top-k 0 --vllm-dtype float32]

Samples --samples-per-prompt responses for --prompts random prompts with a colocated vLLM engine, recomputes
their log-probs with the Megatron actor (the HF weights under --tp/--pp, at the sampling
temperature), and prints one JSON line with the mean and max absolute gap over response
tokens. With --top-p < 1 or --top-k the gap is the truncation's (the trainer models the
full tempered distribution); with --vllm-dtype bfloat16 it is the rollout precision's. Starts itself under torchrun
with TP*PP processes. Exit code 1 when a token's gap exceeds atol + rtol * |actor log-prob|
(fp32 defaults: log-probs of a few nats agree to ~1e-6 between the engines; sampled tokens
far in the tail have log-probs of -20 and more, whose rounding scales with them).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from megatron_rl.procutil import exit_now


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vllm-tp", type=int, default=1)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples-per-prompt", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--vllm-dtype", default="float32")
    p.add_argument("--rtol", type=float, default=1e-5)
    p.add_argument("--atol", type=float, default=1e-4)
    return p.parse_args(argv)


@record
def worker(a) -> None:
    from megatron_rl.data.batch import samples_to_batch
    from megatron_rl.models.hf_config import read_hf_config
    from megatron_rl.numerics import Tolerance, compare
    from megatron_rl.parallel import distributed
    from megatron_rl.rollout.parity import engine_token_logprobs, logprob_gap
    from megatron_rl.rollout.types import EngineConfig, SamplingConfig
    from megatron_rl.rollout.vllm_engine import VLLMEngine
    from megatron_rl.workers.policy import ReferencePolicy
    from megatron_rl.workers.spec import RoleModel

    arch = read_hf_config(a.hf_dir)
    layout = distributed.ParallelLayout(
        tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=a.pp
    )
    ctx = distributed.initialize(layout, arch=arch)
    # forward-only: no optimizer state needed
    policy = ReferencePolicy(
        RoleModel(arch, layout, model_path=a.hf_dir), temperature=a.temperature
    )
    engine = VLLMEngine(
        a.hf_dir,
        EngineConfig(
            external_launcher=True,
            tensor_parallel_size=a.vllm_tp,
            max_model_len=1024,
            dtype=a.vllm_dtype,
        ),
    )
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, arch.vocab_size, (8,), generator=g).tolist() for _ in range(a.prompts)
    ]
    sampling = SamplingConfig(
        n=a.samples_per_prompt,
        max_new_tokens=a.max_new_tokens,
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
    )
    samples = engine.generate(prompts, sampling)
    batch = samples_to_batch(samples)
    sampled = torch.zeros(batch.input_ids.shape)  # the log-probs vLLM reported while sampling
    for i, s in enumerate(samples):
        start = len(s.prompt_token_ids)
        sampled[i, start : start + len(s.logprobs)] = torch.tensor(s.logprobs)
    actor_lp = policy.compute_logprobs(batch)
    gap = logprob_gap(sampled, actor_lp, batch.response_mask)
    on_response = batch.response_mask.bool()
    within = compare(sampled[on_response], actor_lp[on_response], Tolerance(a.rtol, a.atol))
    rescored = None
    if a.temperature == 1.0 and a.top_p == 1.0 and a.top_k <= 0:  # scoring is at T = 1
        rescored = logprob_gap(engine_token_logprobs(engine, batch), sampled, batch.response_mask)
    if ctx.rank == 0:
        result = {
            "layout": f"TP{a.tp}PP{a.pp}",
            "vllm_tp": a.vllm_tp,
            "vllm_dtype": a.vllm_dtype,
            "temperature": a.temperature,
            "top_p": a.top_p,
            "top_k": a.top_k,
            "response_tokens": int(batch.response_mask.sum()),
            **gap,
            "engine_sampling_vs_rescoring_max": rescored and rescored["logprob_gap_max"],
            "rtol": a.rtol,
            "atol": a.atol,
            "max_rel_diff": within.max_rel_diff,
            "ok": within.ok,
        }
        print(json.dumps(result), flush=True)
    distributed.destroy()


def main(argv=None) -> None:
    from checkpoints_convert.common import under_torchrun
    from megatron_rl.launch import TorchrunError, run_torchrun

    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    if under_torchrun():
        return worker(a)
    try:
        out = run_torchrun(
            "tools.logprob_diff", argv, nproc=max(a.tp * a.pp, a.vllm_tp), timeout=3600
        ).output
    except TorchrunError as e:
        raise SystemExit(f"error: {e}") from None
    line = next(ln for ln in out.splitlines() if ln.startswith("{"))
    print(line)
    if not json.loads(line)["ok"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
    exit_now()  # past the interpreter's teardown of torch, megatron and vLLM
