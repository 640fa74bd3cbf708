"""The GPU campaign: what only a GPU can measure, part by part, for a short GPU window.

    python -m tools.gpu_campaign [--out-dir bench/gpu_campaign] [--only NAME ... |
        --verdict-call K] [--list] [--copy-to $OUT] [--budget-s SECONDS]

Every session lent a GPU runs it first and commits the report. Each part is a subprocess
(`python -m ...` from the repository root) with its own time limit (<= 540 s, so one part
fits one 10-minute device call); its output goes, as it runs, to DIR/<part>.log, and after
each part DIR/report.json is rewritten (temp file, then os.replace): a window that ends
mid-part leaves the earlier parts' results; `--copy-to` copies the report and logs out after
each part too (a device call brings back only what its $OUT holds when it ends). With
`--budget-s` (the seconds this device call has left) each part's limit is cut to what is
left of it, less RESERVE_S for the report, the verdict and the copy; a part that would get
under MIN_PART_S is not started (skipped: not reached). A SIGTERM (`timeout` ending the
call) kills the running part's tree, records it as a timeout and copies what was measured.
`--only` merges into an existing report.
A part is `skipped`, never passed, with the reason: no CUDA device, fewer devices than it
needs, or the modules it needs (named) not installed. A skip does not replace a part's
earlier run in the report (a CPU machine, or a GPU without a module, would erase what a
window measured): that run stays, its `skipped_since` saying since when and why it is not
re-run. At the end it prints what the report says against the training step's bars and which
open choices it decides (`tools/gpu_verdict.py`); `--verdict-call 1`, then `2`, run every
part that verdict reads, in two device calls (VERDICT_CALLS). Parts (`--list` prints them):

- env:                versions, devices, NCCL, which packages import (tools/gpu_env.py);
                      always runs, also without CUDA
- gpu_tests:          the GPU-only tests (tests/test_gpu.py: bf16 actor step, TE spec, FP8,
                      distributed-optimizer checkpoint, offloading, NCCL roles, fused AdamW;
                      and those of the other files in GPU_TEST_FILES)
- train_step_bf16:    `tools.bench train_step` on CUDA in bf16 (MFU, peak memory vs plan),
                      Qwen2.5-0.5B, 4 x 2,048 tokens, beside the plain-PyTorch peer
                      (transformers + SDPA + fused AdamW, mixed precision; each arm's
                      peak memory alone: --memory), and beside the update whose head
                      recomputes its logits (`--logits-checkpointing`)
- train_step_lora:    the same shape with the LoRA actor's update (rank 16, every linear)
                      beside the full one (`--lora-rank 16`)
- train_step_1b_4k, train_step_16k, train_step_32k: the same at 1.4B x 8 x 4,096 and
                      0.5B x 1 x 16,384 / 32,768 tokens, every arm alone (--apart); at
                      16k the update with the head's tile sums compiled too
                      (`--compiled-head-forward`), at 32k the head recomputing its logits
- profile_2k, profile_16k: one more step of each arm under torch.profiler (`--profile`): the
                      costliest kernels, the device's busy share, the host's synchronisations;
                      at 16k also the update with the head's tile sums compiled
                      (`--compiled-head-forward`)
- head_tile:          `tools.bench head`: one tile of the chunked head's forward, its sums
                      eager against compiled (Triton), dynamic and static shapes, and
                      against the eager form with torch's fused softmax
- long_cot_peer:      `tools.bench long_cot` in bf16, 0.5B: packed and token-budget
                      micro-batches vs the peer padding every row to the longest
- train_step_fp8:     the same with FP8 GEMMs, needs Transformer Engine
- trainer_hf_rollout: the trainer itself: two PPO steps of examples/tiny/ppo.yaml (actor,
                      critic, reference) on one GPU, bf16 params, rollouts by Hugging Face
                      generate (`rollout.name=hf`, no vLLM); its metrics.jsonl and
                      memory_timeline.jsonl go into the report
- nccl_two_ranks_one_gpu: can two ranks share one GPU under NCCL (tools/gpu_nccl_probe.py)
- disaggregated_nccl:  the same two PPO steps with `rollout.placement=disaggregated`: one
                      trainer rank and one engine rank (HF generate) on the one GPU, as two
                      one-process torchrun nodes with a NCCL_HOSTID each
                      (tools/gpu_two_nodes.py), one-step-off (async.max_staleness=1), 3
                      steps: the bridge's NCCL broadcasts of the weights
- worker_tp_pp:       the worker-level TP=2 / PP=2 torchrun tests; needs 2 GPUs (why: below)
- worker_tp_pp_one_gpu: the same tests on one GPU, each rank a torchrun node of its own
                      (MEGATRON_RL_RANKS_AS_NODES=1: megatron_rl.launch.run_torchrun)
- weight_sync:        `tools.bench weight_sync` (Megatron -> vLLM GB/s; a LoRA policy merged
                      and as adapters), needs vLLM
- logprob_gap_bf16:   `tools.logprob_diff` with a bf16 vLLM rollout, needs vLLM
- sleep_wake:         two GRPO steps with vLLM asleep while Megatron trains (its
                      memory_timeline.jsonl), needs vLLM

The project never needs a GPU to build or pass its tests; this only measures.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.launch import RANKS_AS_NODES_ENV, kill_tree
from tools import gpu_verdict

REPO = Path(__file__).resolve().parent.parent
MAX_TIMEOUT_S = 540
"""A part must end inside one device call (10 minutes) with time to spare for the rest."""
STATUSES = ("passed", "failed", "skipped", "timeout")
MEGATRON, TE, VLLM = ("megatron.core",), ("transformer_engine",), ("vllm",)
PEER = ("transformers",)
GPU_TEST_FILES = (
    "tests/test_gpu.py",
    "tests/parallel/test_multi_tensor_unit.py",
    "tests/rollout/test_hf_engine_unit.py",
    "tests/trainer/test_memory_timeline_unit.py",
)
"""Every test file with GPU-marked tests (`-m gpu` runs those alone)."""
TWO_RANKS_ONE_GPU = (
    "two ranks on one GPU do not work here: NCCL refuses them at set-up ('Duplicate GPU "
    "detected'); gloo takes CUDA tensors only for broadcast/all_reduce, not the all_gather, "
    "reduce_scatter and send/recv of SP and PP; megatron_rl.parallel.distributed puts rank i on cuda:i "
    "(LOCAL_RANK). The nccl_two_ranks_one_gpu part tries the one route left (NCCL_HOSTID "
    "per rank, two one-process torchrun nodes)"
)


VERDICT_CALLS = (
    ("env", "train_step_bf16", "train_step_16k", "head_tile"),
    ("train_step_1b_4k", "train_step_32k", "long_cot_peer", "gpu_tests"),
)
"""Every part `tools.gpu_verdict` reads, as two device calls (`--verdict-call 1`, then 2):
~370 s, and ~285 s before the GPU tests (71 s on 2026-11-28, when they were 13 of today's
~30), by the 2026-11-28 H200 window's part times and the arms added since, each inside a
10-minute call with its install. The bars' shapes come first and the GPU tests last, so that a window cut short (by
`--budget-s`: a session's 15 minutes hold the machine's start too) loses the tests, not a bar."""
RESERVE_S = 20
"""Of a call's `--budget-s`, the seconds kept after the last part: the report, the verdict, the
copy to $OUT."""
MIN_PART_S = 30
"""A part that would get fewer seconds than this of `--budget-s` is not started."""


class CampaignStopped(Exception):
    """A SIGTERM reached the campaign (`timeout` ending the device call)."""


def _stop(signum, frame) -> None:
    raise CampaignStopped(signal.Signals(signum).name)


@dataclass(frozen=True)
class Part:
    name: str
    argv: tuple[str, ...]
    """Run as `python -m <argv>` from the repository root."""
    needs: tuple[str, ...] = ()
    """Modules that must be installed (else: skipped, naming them)."""
    gpus: int = 1
    """CUDA devices it needs (0: runs anywhere)."""
    timeout_s: int = MAX_TIMEOUT_S
    artifacts: tuple[str, ...] = ()
    """Files (relative to the work dir) whose JSON lines go into the report."""
    tiny_model: bool = False
    """Needs the tiny HF checkpoint made at WORK/tiny before it runs."""
    gpus_reason: str = ""
    """Why it needs that many devices (said when it is skipped for fewer)."""
    env: tuple[tuple[str, str], ...] = ()
    """Extra environment of its subprocess."""

    def __post_init__(self) -> None:
        if not 0 < self.timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(
                f"part {self.name}: timeout_s={self.timeout_s}, expected 1..{MAX_TIMEOUT_S}"
            )


def parts(work: Path) -> list[Part]:
    """The campaign, in the order it runs; `work` holds the tiny model and run outputs."""
    tiny, results = str(work / "tiny"), ("--out", str(work / "bench.jsonl"))
    shape = ("--preset", "qwen2.5-0.5b")
    train_step = ("tools.bench", "train_step", "--dtype", "bf16", *shape, "--seq-length", "2048")

    def trainer(run: str, recipe: str, *overrides: str, steps: int = 2) -> tuple[str, ...]:
        # each trainer part its own output dir: a second would resume from the first's save
        return (
            "megatron_rl.launch",
            "--nproc-per-node=1",
            "-m",
            "megatron_rl.cli.train",
            "--config",
            recipe,
            f"model.path={tiny}",
            f"trainer.output_dir={work / run}",
            f"trainer.total_steps={steps}",
            "model.precision.params_dtype=bfloat16",
            *overrides,
        )

    def timeline(run: str) -> tuple[str, ...]:
        return (f"{run}/metrics.jsonl", f"{run}/memory_timeline.jsonl")

    return [
        Part("env", ("tools.gpu_env",), gpus=0, timeout_s=120),
        # -v: each test's outcome by name as it ends (a run cut by --budget-s keeps those);
        # -rfEsp: all of them again in the summary (tools/gpu_verdict.py reads either)
        Part("gpu_tests", ("pytest", "-v", "-rfEsp", "-m", "gpu", *GPU_TEST_FILES),
             needs=("pytest", *MEGATRON, *PEER)),
        # ours against the plain-PyTorch peer (transformers + SDPA + fused AdamW, mixed
        # precision), each arm's peak memory alone: 0.5B x 4 x 2k, then the long shapes; and
        # ours against ours with megatron-core's own linears, RoPE, activation or layer forward,
        # alternating
        Part("train_step_bf16",
             (*train_step, "--memory", "--logits-checkpointing",
              "--without", "linear", "rope", "swiglu", "layer", *results),
             needs=MEGATRON + PEER),
        # the LoRA actor's update (rank 16 on every linear) beside the full one, same shape
        Part("train_step_lora", (*train_step, "--lora-rank", "16", "--memory", *results),
             needs=MEGATRON + PEER),
        # the longer shapes: every arm alone (--apart), two models do not fit one GPU there
        Part(
            "train_step_1b_4k",
            (*train_step[:-4], "--preset", "qwen2-1b", "--seq-length", "4096",
             "--micro-batch-size", "4", "--steps", "4", "--apart", *results),
            needs=MEGATRON + PEER,
        ),
        *(
            Part(
                f"train_step_{length // 1024}k",
                (*train_step[:-1], str(length), "--micro-batch-size", "1",
                 "--num-microbatches", "1", "--steps", "3", "--warmup", "1", "--apart",
                 extra_arm, *results),
                needs=MEGATRON + PEER,
            )
            # at 16k the update with compiled tile sums too, at 32k the head recomputing
            for length, extra_arm in ((16384, "--compiled-head-forward"),
                                      (32768, "--logits-checkpointing"))
        ),
        # where the PPO update's time over a plain forward-backward goes: one profiled step
        # of each arm (top kernels, the device's busy share, host synchronisations)
        Part("profile_2k", (*train_step, "--steps", "2", "--profile", *results),
             needs=MEGATRON + PEER),
        # at 16k also the update with the head's tile sums compiled (an arm of its own)
        Part(
            "profile_16k",
            (*train_step[:-1], "16384", "--micro-batch-size", "1", "--num-microbatches", "1",
             "--steps", "1", "--warmup", "1", "--apart", "--profile",
             "--compiled-head-forward", *results),
            needs=MEGATRON + PEER,
        ),
        # one tile of the head's forward (8,192 tokens x 8,192 rows, qwen2.5-0.5b's width):
        # its sums eager, as the head runs them, against compiled with dynamic / static shapes
        Part(
            "head_tile",
            ("tools.bench", "head", "--tokens", "8192", "--rows", "8192", "--hidden", "896",
             "--dtype", "bf16", *results),
            needs=("triton",), timeout_s=300,
        ),
        Part(
            "long_cot_peer",
            ("tools.bench", "long_cot", *shape, "--dtype", "bf16", "--rows", "16",
             "--median", "1024", "--max-length", "8192", "--micro-batch-size", "1",
             "--steps", "2", *results),
            needs=MEGATRON + PEER,
        ),
        Part("train_step_fp8", (*train_step, "--fp8", "hybrid", *results), needs=MEGATRON + TE),
        Part(
            "trainer_hf_rollout",
            trainer("run_hf", "examples/tiny/ppo.yaml", "rollout.name=hf"),
            needs=(*MEGATRON, "transformers", "datasets", "megatron_rl.rollout.hf_engine"),
            artifacts=timeline("run_hf"), tiny_model=True,
        ),
        Part("nccl_two_ranks_one_gpu", ("tools.gpu_nccl_probe",), timeout_s=240),
        Part(
            "disaggregated_nccl",
            # trainer()'s launcher prefix swapped for a node per rank
            ("tools.gpu_two_nodes", "--timeout-s", "330", "-m", "megatron_rl.cli.train",
             *trainer("run_apart", "examples/tiny/ppo.yaml", "rollout.name=hf",
                      "rollout.placement=disaggregated", "rollout.engine_ranks=1",
                      "async.max_staleness=1", steps=3)[4:]),
            needs=(*MEGATRON, "transformers", "datasets"),
            artifacts=timeline("run_apart"), tiny_model=True, timeout_s=360,
        ),
        Part(
            "worker_tp_pp",
            ("pytest", "-q", "tests/test_megatron_distributed.py",
             "tests/workers/test_workers_distributed.py"),
            needs=("pytest", *MEGATRON), gpus=2, gpus_reason=TWO_RANKS_ONE_GPU,
        ),
        Part(
            "worker_tp_pp_one_gpu",
            ("pytest", "-q", "tests/test_megatron_distributed.py",
             "tests/workers/test_workers_distributed.py"),
            needs=("pytest", *MEGATRON), env=((RANKS_AS_NODES_ENV, "1"),),
        ),
        # with a rank-16 LoRA policy's merged and adapter syncs, and generation after each
        Part("weight_sync", ("tools.bench", "weight_sync", *shape, "--lora-rank", "16", *results),
             needs=MEGATRON + VLLM),
        Part(
            "logprob_gap_bf16",
            ("tools.logprob_diff", "--hf-dir", tiny, "--vllm-dtype", "bfloat16", "--prompts", "8"),
            needs=MEGATRON + VLLM, tiny_model=True,
        ),
        Part(
            "sleep_wake",
            trainer(
                "run_vllm", "examples/tiny/grpo.yaml", "parallel.tensor_model_parallel_size=1",
                "actor.grad_offload=true",
            ),
            needs=MEGATRON + VLLM, artifacts=timeline("run_vllm"), tiny_model=True,
        ),
    ]  # fmt: skip


def cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def skip_reason(part: Part, devices: int) -> str | None:
    """Why `part` cannot run here (every reason, '; '-joined), or None."""
    reasons = []
    if part.gpus and devices == 0:
        reasons.append("no CUDA device")
    elif part.gpus > devices:
        why = f": {part.gpus_reason}" if part.gpus_reason else ""
        reasons.append(f"needs {part.gpus} CUDA devices, this machine has {devices}{why}")
    missing = [m for m in part.needs if not _installed(m)]
    if missing:
        reasons.append(f"needs {', '.join(missing)} (not installed)")
    return "; ".join(reasons) or None


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def json_lines(text: str) -> list:
    """The JSON objects among the lines of `text` (benchmarks print one line each)."""
    found = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                found.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a log line that only looks like JSON
    return found


def run_part(part: Part, work: Path, log: Path, timeout_s: int | None = None) -> dict:
    """Run one part with its time limit (`timeout_s`, else its own), its output streamed to
    `log`; its report record (`stopped`: a SIGTERM ended it, and the campaign)."""
    limit = timeout_s or part.timeout_s
    record: dict = {"command": "python -m " + " ".join(part.argv), "log": str(log)}
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **dict(part.env)}
    start = time.perf_counter()
    with log.open("w") as out:
        out.write(f"$ {record['command']}\n")
        out.flush()
        # A session of its own: on a timeout the whole tree goes (torchrun's workers too).
        proc = subprocess.Popen(
            [sys.executable, "-m", *part.argv],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        stopped = None
        try:
            proc.wait(timeout=limit)
            status = "passed" if proc.returncode == 0 else "failed"
        except (subprocess.TimeoutExpired, CampaignStopped) as e:
            stopped = e if isinstance(e, CampaignStopped) else None
            kill_tree(proc)
            proc.wait()
            status = "timeout"
    record["status"] = status
    record["returncode"] = proc.returncode
    record["seconds"] = round(time.perf_counter() - start, 1)
    if stopped is not None:
        record["reason"] = f"stopped with the campaign ({stopped}) after {record['seconds']} s"
        record["stopped"] = True
    elif status == "timeout":
        cut = " (cut to fit --budget-s)" if limit < part.timeout_s else ""
        record["reason"] = f"killed after its limit of {limit} s{cut}"
    text = log.read_text(errors="replace")
    record["results"] = json_lines(text)
    record["output_tail"] = text[-3000:]
    artifacts = {}
    for name in part.artifacts:
        path = work / name
        if path.exists():
            artifacts[Path(name).name] = json_lines(path.read_text(errors="replace"))
    if artifacts:
        record["artifacts"] = artifacts
    return record


def load_report(path: Path) -> dict:
    """The report to merge into: `path`'s, or a new one."""
    if not path.exists():
        return {"date": None, "env": None, "parts": {}}
    try:
        report = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e}); move it away to start anew") from e
    if not isinstance(report, dict) or not isinstance(report.get("parts"), dict):
        raise ValueError(f"{path}: expected a campaign report, an object with a 'parts' object")
    return report


def write_report(path: Path, report: dict) -> None:
    """Write atomically: a reader (or a window that ends now) sees the old or the new file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(report, indent=1) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def run_campaign(
    plan: Sequence[Part],
    out_dir: Path,
    work: Path,
    deadline: float | None = None,
    after_part: Callable[[], None] | None = None,
) -> dict:
    """Run `plan` in order, rewriting out_dir/report.json after each part, then calling
    `after_part`. `deadline` (time.monotonic()): each part's limit cut to end RESERVE_S before
    it; a part left under MIN_PART_S is skipped. A SIGTERM while a part runs ends the plan."""
    out_dir.mkdir(parents=True, exist_ok=True)
    report_path = out_dir / "report.json"
    report = load_report(report_path)
    devices = cuda_devices()
    for part in plan:
        reason = skip_reason(part, devices)
        limit = part.timeout_s
        if reason is None and deadline is not None:
            left = int(deadline - time.monotonic()) - RESERVE_S
            limit = min(limit, left)
            if left < MIN_PART_S:
                reason = f"not reached: {max(left, 0)} s of --budget-s left for it"
        if reason:
            earlier = report["parts"].get(part.name, {})
            if earlier.get("status", "skipped") != "skipped":
                # a machine that cannot run a part does not erase what one that could
                # measured; the first such skip is kept: skipped since then
                earlier.setdefault("skipped_since", {"reason": reason, "finished": _now()})
                write_report(report_path, report)
                print(f"gpu_campaign: {part.name}: skipped {reason}; its run of "
                      f"{earlier.get('finished')} kept", flush=True)  # fmt: skip
                continue
            record = {"status": "skipped", "reason": reason}
        else:
            print(f"gpu_campaign: {part.name} (limit {limit} s) ...", flush=True)
            if part.tiny_model and not (work / "tiny").exists():
                from examples.tiny_model import TinyModelSpec, make_tiny_model

                make_tiny_model(work / "tiny", TinyModelSpec())
            record = run_part(part, work, out_dir / f"{part.name}.log", limit)
        record["finished"] = _now()
        report["parts"][part.name] = record
        if part.name == "env" and record["status"] == "passed" and record["results"]:
            report["env"] = record["results"][-1]
        report["date"] = record["finished"]
        write_report(report_path, report)
        print(f"gpu_campaign: {part.name}: {record['status']} {reason or ''}".rstrip(), flush=True)
        if after_part is not None:
            after_part()
        if record.get("stopped"):
            print("gpu_campaign: stopped by a signal; the parts after it not run", flush=True)
            break
    return report


def copy_results(out_dir: Path, names: Sequence[str], dest: Path) -> None:
    """report.json and the logs of `names` only: a device call brings back at most 8 files."""
    dest.mkdir(parents=True, exist_ok=True)
    for path in [out_dir / "report.json", *(out_dir / f"{n}.log" for n in names)]:
        if path.exists():
            shutil.copy2(path, dest / path.name)


def _now() -> str:
    return datetime.datetime.now().isoformat(timespec="seconds")


def describe(part: Part) -> str:
    needs = ",".join(part.needs) or "-"
    return f"{part.name:<24} {part.timeout_s:>4}s gpus={part.gpus} needs={needs:<40} python -m {' '.join(part.argv)}"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", default="bench/gpu_campaign", help="report.json and logs")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--only", nargs="+", metavar="NAME", help="part names (default: all)")
    which.add_argument(
        "--verdict-call",
        type=int,
        choices=range(1, len(VERDICT_CALLS) + 1),
        help="the parts of this device call of the two that measure every bar and choice "
        "tools.gpu_verdict reads",
    )
    p.add_argument("--list", action="store_true", help="print the parts and exit")
    p.add_argument(
        "--copy-to",
        metavar="DIR",
        help="copy report.json and this run's logs there after each part (the device call's $OUT)",
    )
    p.add_argument(
        "--budget-s",
        type=int,
        metavar="SECONDS",
        help="the seconds this run may take (what is left of the device call): each part's "
        f"limit cut to fit, {RESERVE_S} s kept for the report, the verdict and the copy",
    )
    a = p.parse_args(argv)
    if a.budget_s is not None and a.budget_s <= RESERVE_S + MIN_PART_S:
        p.error(f"--budget-s {a.budget_s}: expected more than {RESERVE_S + MIN_PART_S} s")
    if a.verdict_call:
        a.only = list(VERDICT_CALLS[a.verdict_call - 1])
    names = [x.name for x in parts(Path("$WORK"))]
    unknown = sorted(set(a.only or ()) - set(names))
    if unknown:
        p.error(f"unknown part(s) {unknown}; parts: {names}")
    if a.list:
        for x in parts(Path("$WORK")):
            print(describe(x))
        return 0
    deadline = None if a.budget_s is None else time.monotonic() + a.budget_s
    out_dir = Path(a.out_dir)
    # a verdict call runs its parts in its own order (the GPU tests last); --only in the plan's
    chosen_names = a.only if a.verdict_call else [n for n in names if not a.only or n in a.only]
    copy = None
    if a.copy_to:
        copy = functools.partial(copy_results, out_dir, chosen_names, Path(a.copy_to))
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        with tempfile.TemporaryDirectory(prefix="gpu_campaign_") as tmp:
            by_name = {x.name: x for x in parts(Path(tmp))}
            chosen = [by_name[n] for n in chosen_names]
            report = run_campaign(chosen, out_dir, Path(tmp), deadline, after_part=copy)
    finally:  # a signal between parts too: what was measured goes out
        signal.signal(signal.SIGTERM, previous)
        if copy is not None:
            copy()
    print(f"gpu_campaign: report in {out_dir / 'report.json'}")
    print(gpu_verdict.verdict(report, gpu_verdict.gpu_tests_log(out_dir)), flush=True)
    records = [report["parts"].get(x.name) for x in chosen]
    if any(r is None or r.get("stopped") or _not_reached(r) for r in records):
        return 1  # a signal or the budget ended this run before some of its parts
    # a part skipped now whose earlier run was kept: this run skipped it
    ran = ["skipped" if "skipped_since" in r else r["status"] for r in records]
    return 0 if all(s in ("passed", "skipped") for s in ran) else 1


def _not_reached(record: dict) -> bool:
    reason = record.get("skipped_since", record).get("reason", "")
    return reason.startswith("not reached")


if __name__ == "__main__":
    raise SystemExit(main())
