"""Print the software stack (versions, CUDA, GPUs, NCCL, Transformer Engine/FP8, vLLM) and
refuse the combinations known not to work, with the reason; exit 1 if there is one.

    python -m megatron_rl.cli.doctor [--json] [--config RECIPE.yaml [key=value ...]]

With --config it also checks what that recipe asks for (bf16, FP8, vLLM) against the
stack. The checks are `megatron_rl.stack`'s pure functions; docs/gpu.md has the pinned
GPU set they are meant to accept.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from megatron_rl.stack import (
    PACKAGES,
    Finding,
    Needs,
    Stack,
    bf16_possible,
    diagnose,
    fp8_possible,
    gather_stack,
)


def needs_of(config) -> Needs:
    """What a `TrainConfig` asks of the stack: its policy's precision, and vLLM unless its
    rollouts are Hugging Face ones (`rollout.name: hf`)."""
    precision = config.model.precision
    return Needs(bf16=precision.bf16, fp8=precision.fp8, vllm=config.rollout.name == "vllm")


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def render(stack: Stack, findings: list[Finding]) -> str:
    """A two-column table of the stack, then the findings; one line says the verdict."""
    rows = [("python", f"{stack.python} ({stack.platform})")]
    for name in PACKAGES:
        rows.append((name, stack.packages.get(name) or "-"))
    if stack.torch_cuda is None:
        rows.append(("CUDA", "CPU stack: no CUDA (torch is a CPU build)"))
    else:
        rows += [
            ("torch CUDA build", stack.torch_cuda),
            ("cuDNN", str(stack.cudnn) if stack.cudnn is not None else "-"),
            ("CUDA available", _yes(stack.cuda_available)),
            ("driver", stack.driver or "-"),
            ("NCCL", stack.nccl or "-"),
            ("torch GPU archs", " ".join(stack.arch_list) or "-"),
        ]
        for i, g in enumerate(stack.gpus):
            cap = f"sm_{g.capability[0]}{g.capability[1]}"
            rows.append((f"GPU {i}", f"{g.name}, {cap}, {g.memory_gib:.1f} GiB"))
        rows += [("bf16 possible", _yes(bf16_possible(stack))),
                 ("fp8 possible", _yes(fp8_possible(stack)))]  # fmt: skip
    if stack.torch_pins:
        pins = ", ".join(f"{n} torch{s}" for n, s in stack.torch_pins.items())
        rows.append(("built for torch", pins))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines.append("")
    for f in findings:
        lines.append(f"{f.level.upper()} [{f.check}] {f.message}")
    errors = sum(f.level == "error" for f in findings)
    lines.append(f"FAIL: {errors} known-bad combination(s)" if errors else "OK")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--config", help="also check what this recipe needs (bf16, fp8, vLLM)")
    p.add_argument("overrides", nargs="*", help="key=value overrides of --config")
    a = p.parse_args(argv)
    if a.overrides and not a.config:
        p.error(f"overrides {a.overrides} need --config")
    needs = None
    if a.config:
        # why: the doctor runs where torch or megatron fail to import; the config loads both
        from megatron_rl.config import ConfigError, load_config

        try:
            needs = needs_of(load_config(a.config, a.overrides))
        except ConfigError as e:
            raise SystemExit(f"config error: {e}") from None
    stack = gather_stack()
    findings = diagnose(stack, needs)
    ok = not any(f.level == "error" for f in findings)
    if a.json:
        out = {
            "ok": ok,
            "stack": asdict(stack),
            "bf16_possible": bf16_possible(stack),
            "fp8_possible": fp8_possible(stack),
            "needs": asdict(needs) if needs is not None else None,
            "findings": [asdict(f) for f in findings],
        }
        print(json.dumps(out, indent=1))
    else:
        print(render(stack, findings))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
