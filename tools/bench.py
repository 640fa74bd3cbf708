"""Benchmarks, each against a baseline run side by side in the same process or script; each
prints one JSON line and appends it to bench/results.jsonl.

    python -m tools.bench list
    python -m tools.bench NAME [--nproc-per-node N] [ARGS...]    (NAME --help for its ARGS)

With --nproc-per-node > 1 the benchmark runs under torchrun (TP/PP layouts).
"""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "train_step": (
        "tools.bench_train_step",
        "actor PPO update vs plain Megatron forward-backward (ratio; MFU and memory on GPU)",
    ),
    "weight_sync": (
        "tools.bench_weight_sync",
        "Megatron -> vLLM weight sync GB/s vs a memory copy of the same bytes",
    ),
    "generate": ("tools.bench_generate", "vLLM generation vs Hugging Face generate, tokens/s"),
    "rollout": (
        "tools.bench_rollout",
        "generate-and-score: Ray reward pool overlapping vLLM vs inline scoring",
    ),
    "long_cot": (
        "tools.bench_long_cot",
        "long-tailed CoT batch: token-budget micro-batches vs padding to the longest, tokens/s",
    ),
    "head": (
        "tools.bench_head",
        "a tile of the chunked log-prob head's forward: its sums eager vs compiled, ms",
    ),
    "rewards": (
        "tools.bench_rewards",
        "math reward samples/s: math_verify (symbolic) vs fast, inline and with the Ray pool",
    ),
    "async": (
        "tools.bench_async",
        "time per PPO step: engines colocated vs on ranks of their own, synchronous and one-step-off",
    ),
    "tools": (
        "tools.bench_tools",
        "multi-turn rollouts with a slow tool: in flight vs turn by turn (speed-up)",
    ),
    "step_breakdown": (
        "tools.bench_step_breakdown",
        "tiny demo RL step: shares of generate / score / experience / train / sync",
    ),
}


def usage() -> str:
    lines = [__doc__.strip(), "", "benchmarks:"]
    lines += [f"  {name:<15} {text}" for name, (_, text) in BENCHMARKS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("list", "-h", "--help"):
        print(usage())
        return 0
    name, args = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"tools.bench: unknown benchmark {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = BENCHMARKS[name][0]
    nproc = 1
    if "--nproc-per-node" in args:
        i = args.index("--nproc-per-node")
        nproc = int(args[i + 1])
        del args[i : i + 2]
    if nproc > 1:
        from megatron_rl.launch import run_torchrun

        run_torchrun(module, args, nproc=nproc, timeout=3600, echo=True)
    else:
        importlib.import_module(module).main(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
