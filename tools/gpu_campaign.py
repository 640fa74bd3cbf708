"""The GPU campaign: everything only a GPU can measure, in one command and one report.

    python -m tools.gpu_campaign [--out bench/gpu_campaign.json] [--only NAME ...] [--list]

Any session that is lent a GPU runs this first and commits the report. Each part runs as
its own subprocess with a time limit; a part whose packages are missing (vLLM, Transformer
Engine) is recorded as skipped with the reason, never as passed. Parts:

- env:           torch / CUDA / device, which of megatron-core, Transformer Engine, vLLM import
- gpu_tests:     the GPU-only tests (tests/test_gpu.py: bf16 kernels, TE spec, FP8, the
                 distributed optimizer's checkpoint)
- train_step_bf16, train_step_fp8: `tools.bench train_step` on CUDA (MFU, peak memory)
- weight_sync:   `tools.bench weight_sync` (Megatron -> vLLM GB/s), needs vLLM
- logprob_gap_bf16: `tools.logprob_diff` with a bf16 rollout against the trainer, needs vLLM
- sleep_wake:    two GRPO steps of the tiny recipe; its memory_timeline.jsonl (peak memory
                 per phase with vLLM asleep while Megatron trains), needs vLLM

The project never needs a GPU to build or pass its tests; this only measures.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

TE, VLLM = ("transformer_engine",), ("vllm",)


@dataclass(frozen=True)
class Part:
    name: str
    argv: tuple[str, ...]
    """Run as `python -m ...` from the repository root."""
    needs: tuple[str, ...] = ()
    """Modules that must import (else: skipped, naming them)."""
    timeout_s: int = 600
    artifacts: tuple[str, ...] = field(default=())
    """Files (relative to the part's work dir) whose contents go into the report."""


def parts(work: Path) -> list[Part]:
    tiny, results = str(work / "tiny"), ("--out", str(work / "bench.jsonl"))
    shape = ("--preset", "qwen2.5-0.5b")
    train_step = ("tools.bench", "train_step", "--dtype", "bf16", *shape, "--seq-length", "2048")
    return [
        Part("gpu_tests", ("pytest", "-q", "-m", "gpu", "tests/test_gpu.py")),
        Part("train_step_bf16", (*train_step, *results)),
        Part("train_step_fp8", (*train_step, "--fp8", "hybrid", *results), needs=TE),
        Part("weight_sync", ("tools.bench", "weight_sync", *shape, *results), needs=VLLM),
        Part(
            "logprob_gap_bf16",
            ("tools.logprob_diff", "--hf-dir", tiny, "--vllm-dtype", "bfloat16", "--prompts", "8"),
            needs=VLLM,
        ),
        Part(
            "sleep_wake",
            (
                "megatron_rl.launch", "--nproc-per-node=1", "-m", "megatron_rl.cli.train",
                "--config", "examples/tiny/grpo.yaml", f"model.path={tiny}",
                f"trainer.output_dir={work / 'run'}", "trainer.total_steps=2",
                "parallel.tensor_model_parallel_size=1", "model.precision.params_dtype=bfloat16",
                "actor.grad_offload=true",
            ),
            needs=VLLM,
            artifacts=("run/memory_timeline.jsonl",),
        ),
    ]  # fmt: skip


def environment() -> dict:
    import torch

    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "packages": {
            m: importlib.util.find_spec(m) is not None
            for m in ("megatron.core", "transformer_engine", "vllm")
        },
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["device"] = {
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 1024**3, 1),
        }
    return env


def run_part(part: Part, work: Path) -> dict:
    missing = [m for m in part.needs if importlib.util.find_spec(m) is None]
    if missing:
        return {"status": "skipped", "reason": f"needs {', '.join(missing)} (not installed)"}
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-m", *part.argv],
            capture_output=True,
            text=True,
            timeout=part.timeout_s,
        )
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "seconds": part.timeout_s}
    out = {
        "status": "passed" if done.returncode == 0 else "failed",
        "returncode": done.returncode,
        "seconds": round(time.perf_counter() - start, 1),
        # Benchmarks and tools print one JSON line each: those are the measurements.
        "results": [json.loads(ln) for ln in done.stdout.splitlines() if ln.startswith("{")],
        "output_tail": (done.stdout + done.stderr)[-3000:],
    }
    for name in part.artifacts:
        path = work / name
        if path.exists():
            out[name] = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/gpu_campaign.json")
    p.add_argument("--only", nargs="*", help="part names (default: all)")
    p.add_argument("--list", action="store_true", help="print the parts and exit")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gpu_campaign_") as tmp:
        work = Path(tmp)
        plan = parts(work)
        names = [x.name for x in plan]
        unknown = sorted(set(a.only or ()) - set(names))
        if unknown:
            p.error(f"unknown part(s) {unknown}; parts: {names}")
        if a.list:
            for x in plan:
                print(f"{x.name:<18} python -m {' '.join(x.argv)}")
            return 0
        import torch

        if not torch.cuda.is_available():
            print("gpu_campaign: no CUDA device here; run it where a GPU is lent", file=sys.stderr)
            return 2
        from megatron_rl.models.tiny import TinyModelSpec, make_tiny_model

        make_tiny_model(work / "tiny", TinyModelSpec())
        report = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "env": environment(), "parts": {}}
        for part in plan:
            if a.only and part.name not in a.only:
                continue
            print(f"gpu_campaign: {part.name} ...", flush=True)
            report["parts"][part.name] = run_part(part, work)
            print(f"gpu_campaign: {part.name}: {report['parts'][part.name]['status']}", flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_name(f".{out.name}.tmp")
    tmp_out.write_text(json.dumps(report, indent=1) + "\n")
    os.replace(tmp_out, out)
    print(f"gpu_campaign: report in {out}")
    return 0 if all(r["status"] in ("passed", "skipped") for r in report["parts"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
