"""How long a stop request mid-step takes to end a run: SIGTERM to `megatron_rl.launch`.

    python -m tools.stop_latency [--reward-delay-s 0.5] [--chunk-size 1] [--into-step-s 3]
        [--max-new-tokens N] [--resume] [--out bench/results.jsonl]

Runs the tiny GRPO recipe (2 ranks, TP=2, a fresh tiny model) with a reward that sleeps
`--reward-delay-s` per sample, so a step is long and mostly scoring; once one step is logged
and `--into-step-s` more seconds have passed, sends SIGTERM to the launcher (as `docker stop`
or SLURM's `--signal=B:TERM` would) and waits for it to exit. Prints one JSON line: seconds
from the signal to the launcher's exit, the phase the workers aborted in, the workers' own
"s after the request" and the save time from their log, and the logged steps' mean
`timing/step_s`, which is what a stop that waits for the step (before stop requests could abort a step) would have added.

`--resume`: then resumes the run for the aborted step alone and adds what the stop kept of
that step's rollout (`kept_tokens`, from the workers' `kept N generated tokens` lines), what
the resumed step took of it (`rollout/resumed_tokens`) and the difference: the tokens the
resume generated a second time (`generated_twice`; before rollouts were kept, every token
the stopped step had generated was).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megatron_rl.launch import kill_tree
from megatron_rl.procutil import free_port
from tools.bench_common import RESULTS, record

DELAY_ENV = "STOP_LATENCY_REWARD_DELAY_S"


def slow_parity(prompt: str, response: str, label) -> float:
    """The reward of the measured run: length parity after a sleep of $STOP_LATENCY_REWARD_DELAY_S."""
    time.sleep(float(os.environ.get(DELAY_ENV, "0.5")))
    return float(len(response) % 2 == 0)


def logged_steps(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("stage") == "train"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reward-delay-s", type=float, default=0.5)
    p.add_argument("--chunk-size", type=int, default=1, help="rollout.rating.chunk_size")
    p.add_argument("--into-step-s", type=float, default=3.0)
    p.add_argument("--max-new-tokens", type=int, help="rollout.max_new_tokens (the recipe's)")
    p.add_argument("--resume", action="store_true", help="resume the aborted step after")
    p.add_argument("--out", default=RESULTS, help="append the JSON line here ('' for nowhere)")
    a = p.parse_args(argv)
    # why: it loads transformers (seconds), which `--help` does not need
    from examples.tiny_model import TinyModelSpec, make_tiny_model

    with tempfile.TemporaryDirectory(prefix="stop_latency_") as tmp:
        model = make_tiny_model(Path(tmp) / "tiny", TinyModelSpec())
        out = Path(tmp) / "run"

        # the recipe's prompts (data.max_prompt_length 128) and the longer responses
        longer = (
            [f"rollout.max_new_tokens={a.max_new_tokens}",
             f"rollout.max_model_len={128 + a.max_new_tokens}"]
            if a.max_new_tokens else []
        )  # fmt: skip

        def command(total_steps: int) -> list[str]:
            return [
                sys.executable, "-m", "megatron_rl.launch", "--nproc-per-node=2",
                "--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={free_port()}",
                "-m", "megatron_rl.cli.train", "--config", "examples/tiny/grpo.yaml",
                f"model.path={model}", f"trainer.output_dir={out}",
                f"trainer.total_steps={total_steps}", "trainer.save_interval=0",
                "trainer.eval_data_path=null",
                f"rollout.rating={{strategy: plain, chunk_size: {a.chunk_size}}}",
                'rewards.reward_fns=[{type: python, path: "tools.stop_latency:slow_parity"}]',
                *longer,
            ]  # fmt: skip

        env = {**os.environ, DELAY_ENV: str(a.reward_delay_s), "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(
            command(50), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        try:
            deadline = time.time() + 600
            while proc.poll() is None and not logged_steps(out) and time.time() < deadline:
                time.sleep(0.2)
            if proc.poll() is not None or not logged_steps(out):
                raise SystemExit(f"the run logged no step:\n{proc.communicate()[0][-4000:]}")
            time.sleep(a.into_step_s)
            signalled = time.time()
            proc.send_signal(signal.SIGTERM)
            output, _ = proc.communicate(timeout=600)
            exit_s = time.time() - signalled
        finally:
            if proc.poll() is None:
                kill_tree(proc)
        steps = logged_steps(out)
        if a.resume:
            done = subprocess.run(
                command(len(steps) + 1), capture_output=True, text=True, env=env, timeout=900
            )
            if done.returncode != 0:
                raise SystemExit(f"the resume failed:\n{(done.stdout + done.stderr)[-4000:]}")
            resumed = logged_steps(out)[len(steps)]
    abort = re.search(r"aborted in (\S+), (?:([\d.]+) s after the request, )?", output)
    save = re.search(r"saved checkpoint \S+ in ([\d.]+) s", output)
    result = {
        "recipe": "examples/tiny/grpo.yaml",
        "reward_delay_s": a.reward_delay_s,
        "chunk_size": a.chunk_size,
        "into_step_s": a.into_step_s,
        "returncode": proc.returncode,
        "signal_to_exit_s": round(exit_s, 2),
        "aborted_in": abort[1] if abort else None,
        "abort_after_request_s": float(abort[2]) if abort and abort[2] else None,
        "save_s": float(save[1]) if save else None,
        "step_s_mean": round(sum(r["timing/step_s"] for r in steps) / len(steps), 2),
        "steps_logged": len(steps),
    }
    if a.resume:
        kept = sum(int(n) for n in re.findall(r"kept (\d+) generated tokens", output))
        took = int(resumed.get("rollout/resumed_tokens", 0))
        result.update(
            max_new_tokens=a.max_new_tokens,
            kept_tokens=kept,
            resumed_tokens=took,
            generated_twice=kept - took,
        )
    record("stop_latency", result, a.out or None)
    return 0 if proc.returncode == 0 and abort else 1


if __name__ == "__main__":
    raise SystemExit(main())
