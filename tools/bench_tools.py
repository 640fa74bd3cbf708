"""Benchmark: multi-turn rollouts with tools in flight vs turn by turn.

    python -m tools.bench tools [--prompts 8 --n 4 --turns 3 --latency-s 0.2 --workers 4]

One vLLM engine on the tiny model with the tool-call tokens (or --model), one environment
pool of `--workers` workers whose tool takes `--latency-s` per call (lognormal around it,
drawn from the call's own text, so both arms meet the same latencies) and answers every turn
for `--turns` turns. Arms, alternately, same prompts and seeds: `run_in_flight` (the engine
keeps generating the other trajectories while tools run; the trainer's loop on vLLM) and
`run_turns` (turn k of every trajectory, then every tool call, then turn k + 1: NeMo-RL's
synchronous loop). Both draw the same trajectories (checked: `same_samples`). Prints the
seconds of each, policy tokens/s, and in-flight's speed-up (one JSON line, appended to
--out). On 2 CPU cores the tool's sleeps overlap with generation; a CPU-bound tool (the real
interpreter) would take cores from vLLM, so its gain would be smaller.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import shutil
import tempfile
import time
from pathlib import Path

from megatron_rl.envs.base import EnvReset, StepResult, Task
from megatron_rl.envs.config import EnvConfig
from megatron_rl.envs.pool import EnvPool
from megatron_rl.rollout.agent import AgentSpec, EnvSteps, run_in_flight, run_turns
from megatron_rl.rollout.tool_formats import call_end_id, tool_format
from megatron_rl.rollout.types import EngineConfig, SamplingConfig
from megatron_rl.rollout.vllm_engine import VLLMEngine
from tools.bench_common import alternate, record


class SlowTool:
    """Answers every turn with "ok" after a latency drawn from the turn's text (lognormal,
    median `latency_s`, sigma 0.5); done after `turns` steps."""

    def __init__(self, latency_s: float, turns: int):
        self.latency_s, self.turns = latency_s, turns

    def reset(self, task):
        return EnvReset(state=0)

    def step(self, state, action):
        digest = hashlib.sha256(action.text.encode()).digest()
        u = (int.from_bytes(digest[:8], "big") + 0.5) / 2**64  # uniform in (0, 1)
        z = math.sqrt(2) * _erfinv(2 * u - 1)
        time.sleep(self.latency_s * math.exp(0.5 * z))
        return StepResult("ok", done=state + 1 >= self.turns, state=state + 1)


def _erfinv(y: float) -> float:
    """Inverse error function (Winitzki's approximation, ~1e-3: enough to shape latencies)."""
    a = 0.147
    ln = math.log(1 - y * y)
    first = 2 / (math.pi * a) + ln / 2
    return math.copysign(math.sqrt(math.sqrt(first * first - ln / a) - first), y)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="an HF checkpoint with `</tool_call>` as one token")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=16, help="per turn")
    p.add_argument("--latency-s", type=float, default=0.2, help="median tool latency")
    p.add_argument("--workers", type=int, default=4, help="tool calls at once")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default="bench/results.jsonl")
    a = p.parse_args(argv)

    from transformers import AutoTokenizer

    work = Path(tempfile.mkdtemp(prefix="bench_tools-"))
    pool = None
    try:
        model_dir = a.model
        if model_dir is None:
            from examples.tiny_model import TinyModelSpec, make_tiny_model

            model_dir = make_tiny_model(work / "model", TinyModelSpec(chat_template="chatml_tools"))
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        fmt = tool_format("code")
        length = a.turns * (a.max_new_tokens + 8)  # every turn and its short answer fit
        spec = AgentSpec(fmt, call_end_id(fmt, tokenizer), a.turns, length)
        engine = VLLMEngine(model_dir, EngineConfig(max_model_len=64 + length))
        pool = EnvPool(EnvConfig(
            type="python", path="tools.bench_tools:SlowTool", num_workers=a.workers,
            kwargs={"latency_s": a.latency_s, "turns": a.turns},
        ))  # fmt: skip
        steps = EnvSteps(pool)
        prompts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": f"What is {7 * i} + {13 * i}?"}],
                add_generation_prompt=True,
            )["input_ids"]
            for i in range(a.prompts)
        ]
        tasks = [Task(None)] * a.prompts
        seeds = list(range(1, a.prompts + 1))
        sampling = SamplingConfig(n=a.n, max_new_tokens=a.max_new_tokens)
        samples = {}

        def arm(name, loop):
            def run():
                samples[name] = loop(
                    engine, prompts, tasks, sampling, seeds, spec, steps, tokenizer
                )

            return run

        seconds = alternate(
            {"in_flight": arm("in_flight", run_in_flight), "turns": arm("turns", run_turns)},
            a.steps,
        )
        engine.shutdown()
    finally:
        if pool is not None:
            pool.close()
        shutil.rmtree(work, ignore_errors=True)
    same = [(s.token_ids, s.env_spans) for s in samples["in_flight"]] == [
        (s.token_ids, s.env_spans) for s in samples["turns"]
    ]
    policy = sum(
        len(s.token_ids) - sum(hi - lo for lo, hi in s.env_spans) for s in samples["turns"]
    )
    calls = sum(len(s.env_spans) for s in samples["turns"])
    return record(
        "tools",
        {
            "model": a.model or "tiny random (chatml_tools)",
            "prompts": a.prompts,
            "samples_per_prompt": a.n,
            "turns": a.turns,
            "max_new_tokens_per_turn": a.max_new_tokens,
            "tool_latency_median_s": a.latency_s,
            "workers": a.workers,
            "answered_calls": calls,
            "policy_tokens": policy,
            "seconds": {k: round(v, 3) for k, v in seconds.items()},
            "policy_tokens_per_s": {k: round(policy / v, 1) for k, v in seconds.items()},
            "speedup_in_flight_over_turns": round(seconds["turns"] / seconds["in_flight"], 3),
            "same_samples": same,
            "steps_measured": a.steps,
        },
        a.out,
    )


if __name__ == "__main__":
    main()
