"""Benchmark: the actor's PPO/VAPO update vs a plain Megatron forward-backward and vs a plain
PyTorch training step, side by side.

    python -m tools.bench train_step --preset tiny [--memory]
    python -m tools.bench train_step --preset qwen2.5-0.5b --dtype bf16 --seq-length 32768 \
        --micro-batch-size 1 --num-microbatches 1 --apart
    python -m tools.bench train_step --nproc-per-node 8 --preset qwen2-1b --dtype bf16 \
        --seq-length 4096 --tp 1 [--fp8 hybrid]

Arms, on the same tokens with one optimizer step each: `plain_megatron`, megatron's fused
cross-entropy (`labels=`) averaged over response tokens, with the actor's model chunks, DDP
and optimizer; `ppo_update`, `Actor.update` (chunked log-probs and entropy, clip-higher PPO,
positive-sample NLL, global token normalisation); with --lora-rank R, `ppo_update_lora`,
the same update of a LoRA actor (rank R on every linear, the base frozen); on one device,
`peer_hf`, what a user of
plain PyTorch runs (`tools/bench_peer.py`: transformers + SDPA + fused AdamW, `--peer`
precision). Arms alternate step by step in one process, so machine noise hits all of them;
ratios of median step times compare them. `--memory` adds each arm's peak memory measured
alone in a child process (CUDA's max allocated, or the resident set's high-water mark on
CPU, above what the process held before it built anything); `--apart` also takes the speeds
from those children, for shapes where two models do not fit one device together.
`--without linear rope swiglu layer` adds, per name, an arm `ppo_update_megatron_<name>`:
the same update with that part put back to megatron-core's own function while the arm runs
(`linear`: `models/linear.py`'s plain products; `rope`: `models/rotary.py`'s RoPE;
`swiglu`: `models/swiglu.py`'s activation, against megatron's unfused one; `layer`:
`models/layer.py`'s decoder-layer forward), and its `speed_ppo_over_megatron_<name>` (> 1:
ours is faster).
`--compiled-head-forward` adds `ppo_update_compiled_head_forward`: the same update with the
chunked head's tile sums and kept probabilities compiled into one kernel a tile
(`model.use_fused_kernels`: `parallel/vocab_fused.tile_sums`), and its
`speed_compiled_head_forward_over_eager` (> 1: compiled is faster).
`--logits-checkpointing` adds `ppo_update_logits_checkpointing`: the same update with the
head recomputing its logits in backward (`actor.logits_checkpointing`) where `ppo_update`
keeps their probabilities, and its `speed_kept_probs_over_logits_checkpointing` (> 1:
keeping is faster); with --memory its peak beside the plan's for it.
`--profile` adds one more step of each arm under torch.profiler: its costliest kernels
printed, the kernels' summed time, their share of the step's wall time (how busy the GPU
was) and the host's synchronisations.
Prints one JSON line and appends it to --out. On a GPU it also reports model FLOPs
utilisation (MFU) against the device's dense bf16 peak, and the ppo_update peak next to
`tools/plan_memory.py`'s estimate for the same layout.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from megatron_rl.data.batch import TrainingBatch
from megatron_rl.models import linear as linear_routes
from megatron_rl.models.architecture import ModelArchitecture
from megatron_rl.models.gpt import PrecisionConfig
from megatron_rl.models.lm_head import emit_hidden_states
from megatron_rl.models.lora import LoRAConfig
from megatron_rl.models.presets import PRESETS, param_count, preset_arch
from megatron_rl.parallel import distributed, vocab_fused
from megatron_rl.procutil import exit_now
from megatron_rl.workers.losses_config import PolicyLossConfig
from megatron_rl.workers.optimizer import OptimConfig
from megatron_rl.workers.policy import Actor
from megatron_rl.workers.roles import set_training
from megatron_rl.workers.schedule import run_schedule
from megatron_rl.workers.spec import RoleModel
from tools.bench_common import alternate, record, timed
from tools.bench_peer import PEER_PRECISIONS, peer_step

DENSE_BF16_PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}


def model_flops_per_token(arch: ModelArchitecture, seq_length: int) -> float:
    """Training FLOPs per token (3x forward), matmuls only, attention over the full sequence
    (Megatron's convention, as in NVIDIA's published MFU)."""
    h, kv = arch.hidden_size, arch.num_query_groups * arch.head_dim
    q = arch.num_attention_heads * arch.head_dim
    per_layer = 2 * (h * q + 2 * h * kv + q * h + 3 * h * arch.ffn_hidden_size)
    attention = 2 * 2 * seq_length * q
    forward = arch.num_layers * (per_layer + attention) + 2 * h * arch.vocab_size
    return 3.0 * forward


def synthetic_batch(arch, sequences: int, seq_length: int, seed: int = 0) -> TrainingBatch:
    """Random tokens; the first quarter of each sequence is prompt, the rest response."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, arch.vocab_size, (sequences, seq_length), generator=g)
    mask = torch.zeros(sequences, seq_length)
    mask[:, seq_length // 4 :] = 1
    return TrainingBatch(
        input_ids=ids,
        response_mask=mask,
        old_logprobs=-torch.rand(sequences, seq_length, generator=g) * 10,
        advantages=torch.randn(sequences, seq_length, generator=g),
        scores=torch.tensor([1.0, -1.0]).repeat((sequences + 1) // 2)[:sequences],
    )


def to_device(batch: TrainingBatch, device) -> TrainingBatch:
    fields = {k: v.to(device) for k, v in vars(batch).items() if isinstance(v, torch.Tensor)}
    return batch.with_fields(**fields)


def plain_step(actor: Actor, batch: TrainingBatch, num_microbatches: int) -> None:
    """Megatron's own fused cross-entropy over response tokens + the same optimizer step as
    the update's (`apply_gradients`: the norm taken once, the clip inside a fused AdamW)."""

    def loss_fn(mb, per_token_ce):
        mask = mb.response_mask[:, 1:]
        loss = (per_token_ce[:, :-1] * mask).sum() / mask.sum()
        return loss, {"loss": loss.detach().clone()}

    def with_labels(chunk):
        forward = chunk.forward

        def call(input_ids, position_ids, attention_mask):
            labels = torch.roll(input_ids, -1, dims=1)
            return forward(input_ids, position_ids, attention_mask, labels=labels)

        return call

    set_training(actor.chunks, True)
    for chunk in actor.chunks:
        chunk.zero_grad_buffer()
    actor.optimizer.zero_grad()
    originals = [c.forward for c in actor.chunks]
    for c in actor.chunks:
        c.forward = with_labels(c)
    emit_hidden_states(actor.chunks, on=False)  # megatron's own output layer and loss
    try:
        run_schedule(actor.chunks, batch.split(num_microbatches), loss_fn, forward_only=False)
    finally:
        emit_hidden_states(actor.chunks, on=True)
        for c, f in zip(actor.chunks, originals, strict=True):
            c.forward = f
    actor.apply_gradients({})


ARMS = (
    "plain_megatron",
    "ppo_update",
    "ppo_update_compiled_head_forward",
    "ppo_update_logits_checkpointing",
    "ppo_update_lora",
    "peer_hf",
)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--fp8", choices=["e4m3", "hybrid"], help="FP8 GEMMs (Transformer Engine)")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--num-microbatches", type=int, default=2)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--peer",
        choices=[*PEER_PRECISIONS, "none"],
        help="the plain-PyTorch arm's precision (default: fp32 with --dtype fp32, mixed with "
        "bf16; none with more than one rank: the peer runs on one device)",
    )
    p.add_argument(
        "--memory",
        action="store_true",
        help="also each arm's peak memory, every arm alone in a process of its own",
    )
    p.add_argument(
        "--apart",
        action="store_true",
        help="every arm alone in a process of its own, for speed and memory (shapes where "
        "two models' states and activations do not fit one device together)",
    )
    p.add_argument("--lora-rank", type=int, default=0, help="add the LoRA actor's update")
    p.add_argument(
        "--without",
        nargs="+",
        default=[],
        choices=sorted(MEGATRON_OWN),
        help="add the update with these parts put back to megatron-core's own functions",
    )
    p.add_argument(
        "--compiled-head-forward",
        action="store_true",
        help="add the update with the chunked head's tile sums compiled into one kernel a "
        "tile (model.use_fused_kernels) instead of eager",
    )
    p.add_argument(
        "--logits-checkpointing",
        action="store_true",
        help="add the update with the head recomputing its logits in backward "
        "(actor.logits_checkpointing) instead of keeping their probabilities",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="after the timed steps, one more step of each arm under torch.profiler: its top "
        "operators printed, and how much of the step the device spent in kernels",
    )
    p.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # a child: one arm alone
    p.add_argument("--out", default="bench/results.jsonl")
    a = p.parse_args(argv)
    if a.without and a.apart:
        raise SystemExit("--without alternates with ppo_update in one process: not with --apart")

    arch = preset_arch(a.preset)
    layout = distributed.ParallelLayout(
        tensor_model_parallel_size=a.tp,
        pipeline_model_parallel_size=a.pp,
        sequence_parallel=a.sequence_parallel,
    )
    ctx = distributed.initialize(layout, arch=arch)
    if a.peer is None:
        a.peer = "none" if ctx.world_size > 1 else "fp32" if a.dtype == "fp32" else "mixed"
    if a.peer != "none" and ctx.world_size > 1:
        raise SystemExit(f"--peer {a.peer} runs on one device; this job has {ctx.world_size}")
    baseline = resident_bytes()
    skipped = {"peer_hf"} if a.peer == "none" else set()
    skipped |= set() if a.lora_rank else {"ppo_update_lora"}
    skipped |= set() if a.compiled_head_forward else {"ppo_update_compiled_head_forward"}
    skipped |= set() if a.logits_checkpointing else {"ppo_update_logits_checkpointing"}
    names = [a.arm] if a.arm else [n for n in ARMS if n not in skipped]
    sequences = a.micro_batch_size * a.num_microbatches
    tokens = sequences * a.seq_length * ctx.dp_size  # tokens per optimizer step, all ranks
    median, busy = {}, {}
    if not a.apart or a.arm:
        batch = synthetic_batch(arch, sequences, a.seq_length, seed=ctx.dp_rank)
        arms = build_arms(names, arch, layout, a, to_device(batch, ctx.device))
        if not a.arm:  # ours against ours with a part put back to megatron's
            arms.update(without_arms(a.without, arms.get("ppo_update")))
        median = alternate(arms, a.steps, a.warmup)
        busy = {name: profiled(name, fn) for name, fn in arms.items()} if a.profile else {}
    if a.arm:  # a child: its time, and its peak above what the process held before the models
        row = {"arm": a.arm, "seconds": median[a.arm], "peak_bytes": peak_bytes() - baseline}
        row.update(busy.get(a.arm, {}), **fell_back())
        print(json.dumps(row), flush=True)
        distributed.destroy()
        return
    result = {
        "preset": a.preset,
        "params_b": round(param_count(arch) / 1e9, 3),
        "layout": f"TP{a.tp}PP{a.pp}DP{ctx.dp_size}" + ("SP" if a.sequence_parallel else ""),
        "dtype": a.dtype + ("+fp8" if a.fp8 else ""),
        "peer": a.peer,
        "arms": "apart" if a.apart else "alternating",
        "seq_length": a.seq_length,
        "micro_batch_size": a.micro_batch_size,
        "num_microbatches": a.num_microbatches,
        "tokens_per_step": tokens,
        "steps": a.steps,
    }
    result.update(fell_back())  # the alternating arms' process
    if torch.cuda.is_available() and not a.apart:
        result.update(memory_vs_plan(arch, a, ctx, torch.cuda.max_memory_allocated()))
    distributed.destroy()
    if a.memory or a.apart:
        alone = arms_alone(argv, names)
        for name, row in alone.items():
            if "error" in row:
                result[f"{name}_error"] = row["error"]
                continue
            result[f"{name}_peak_gib"] = round(row["peak_bytes"] / 2**30, 4)
            if a.apart:
                median[name] = row["seconds"]
                busy[name] = {k: row[k] for k in (*PROFILED, FELL_BACK) if k in row}
        if "peak_bytes" in alone.get("ppo_update", {}) and "peak_bytes" in alone.get("peer_hf", {}):
            result["memory_ppo_over_peer"] = round(
                alone["ppo_update"]["peak_bytes"] / alone["peer_hf"]["peak_bytes"], 4
            )
        # the plan is for one PPO update alone: compare it with that arm's own peak, not
        # with the alternating process's (which holds every arm's model at once)
        if torch.cuda.is_available() and "peak_bytes" in alone.get("ppo_update", {}):
            result.update(memory_vs_plan(arch, a, ctx, alone["ppo_update"]["peak_bytes"]))
        if torch.cuda.is_available() and "peak_bytes" in alone.get("ppo_update_lora", {}):
            lora = memory_vs_plan(
                arch, a, ctx, alone["ppo_update_lora"]["peak_bytes"], lora_rank=a.lora_rank
            )
            result.update({f"lora_{k}": v for k, v in lora.items()})
        lean = alone.get("ppo_update_logits_checkpointing", {})
        if torch.cuda.is_available() and "peak_bytes" in lean:
            plan = memory_vs_plan(arch, a, ctx, lean["peak_bytes"], logits_checkpointing=True)
            result.update({f"logits_checkpointing_{k}": v for k, v in plan.items()})
    if a.lora_rank:
        result["lora_rank"] = a.lora_rank
    if {"ppo_update", "ppo_update_lora"} <= set(median):
        result["ratio_lora_over_ppo"] = round(median["ppo_update_lora"] / median["ppo_update"], 4)
    if {"ppo_update_peak_gib", "ppo_update_lora_peak_gib"} <= set(result):
        result["memory_lora_over_ppo"] = round(
            result["ppo_update_lora_peak_gib"] / result["ppo_update_peak_gib"], 4
        )
    if {"ppo_update", "plain_megatron"} <= set(median):
        result["ratio_ppo_over_plain"] = round(median["ppo_update"] / median["plain_megatron"], 4)
    for part in a.without:
        result[f"speed_ppo_over_megatron_{part}"] = round(
            median[f"ppo_update_megatron_{part}"] / median["ppo_update"], 4
        )
    if {"ppo_update", "ppo_update_logits_checkpointing"} <= set(median):
        result["speed_kept_probs_over_logits_checkpointing"] = round(
            median["ppo_update_logits_checkpointing"] / median["ppo_update"], 4
        )
    if {"ppo_update", "ppo_update_compiled_head_forward"} <= set(median):
        result["speed_compiled_head_forward_over_eager"] = round(
            median["ppo_update"] / median["ppo_update_compiled_head_forward"], 4
        )
    if {"ppo_update", "peer_hf"} <= set(median):
        # tokens/s of ours over the peer's (> 1: ours is faster)
        result["speed_ppo_over_peer"] = round(median["peer_hf"] / median["ppo_update"], 4)
    for name, fields in busy.items():
        result.update({f"{name}_{k}": v for k, v in fields.items()})
    flops = model_flops_per_token(arch, a.seq_length) * tokens
    peak = _peak_tflops()
    for name, t in median.items():
        result[f"{name}_s"] = round(t, 4)
        result[f"{name}_tokens_per_s"] = round(tokens / t, 1)
        if peak:
            result[f"{name}_mfu"] = round(flops / t / (peak * 1e12 * ctx.world_size), 4)
    if ctx.rank == 0:
        record("train_step", result, a.out)


def build_arms(names, arch, layout, a, batch) -> dict:
    """The step functions of the arms `names` (the actor built only when an arm needs it)."""
    arms = {}
    precision = PrecisionConfig(
        params_dtype=torch.bfloat16 if a.dtype == "bf16" else torch.float32, fp8=a.fp8
    )
    loss_cfg = PolicyLossConfig(nll_coef=0.1)
    ours = {
        "plain_megatron",
        "ppo_update",
        "ppo_update_compiled_head_forward",
        "ppo_update_logits_checkpointing",
    }
    if ours & set(names):
        actor = Actor(RoleModel(arch, layout, precision=precision), optim=OptimConfig())
        if "plain_megatron" in names:
            arms["plain_megatron"] = lambda: plain_step(actor, batch, a.num_microbatches)
        if "ppo_update" in names:
            arms["ppo_update"] = lambda: actor.update(batch, loss_cfg, a.num_microbatches)
        # the same update with one of the actor's switches on while the arm runs
        for name, switch in (
            ("ppo_update_compiled_head_forward", "use_fused_kernels"),
            ("ppo_update_logits_checkpointing", "logits_checkpointing"),
        ):
            if name in names:
                arms[name] = functools.partial(switched_update, actor, switch, batch, loss_cfg, a)
    if "ppo_update_lora" in names:
        lora = LoRAConfig(rank=a.lora_rank, alpha=2.0 * a.lora_rank)
        model = RoleModel(arch, layout, precision=precision, lora=lora)
        lora_actor = Actor(model, optim=OptimConfig())
        arms["ppo_update_lora"] = lambda: lora_actor.update(batch, loss_cfg, a.num_microbatches)
    if "peer_hf" in names:
        arms["peer_hf"] = peer_step(a.preset, a.peer, batch, a.num_microbatches)
    return arms


def switched_update(actor: Actor, switch: str, batch, loss_cfg, a) -> None:
    """`Actor.update` with the actor's boolean attribute `switch` on, off again after."""
    setattr(actor, switch, True)
    try:
        actor.update(batch, loss_cfg, a.num_microbatches)
    finally:
        setattr(actor, switch, False)


MEGATRON_OWN = {
    "linear": ("megatron.core.tensor_parallel.layers", linear_routes.ROUTED),
    "rope": ("megatron.core.transformer.attention", ("apply_rotary_pos_emb",)),
    "swiglu": ("megatron.core.transformer.mlp", ("bias_swiglu_impl",)),
    "layer": ("megatron.core.transformer.transformer_layer:TransformerLayer", ("forward",)),
}
"""The parts `--without` can put back: where megatron looks each function up (a module, or
`module:Class` for a method), and its names there (each our route, holding megatron's own as
`.megatron_fn`)."""


def _megatron_glu(input, bias, fp8_input_store=False, cpu_offload_input=False):  # noqa: A002
    """What megatron's MLP computes without activation fusion (its `glu`, offset 0), in
    place of its fused kernel, which compiles (`torch.compile`) on first use."""
    x_glu, x_linear = torch.chunk(input if bias is None else input + bias, 2, dim=-1)
    return torch.nn.functional.silu(x_glu) * (x_linear + 0.0)


UNFUSED = {"bias_swiglu_impl": _megatron_glu}


@contextmanager
def megatron_own(part: str):
    """Within: megatron-core's own functions in place of our routes of `part`."""
    where, names = MEGATRON_OWN[part]
    module_name, _, class_name = where.partition(":")
    owner = importlib.import_module(module_name)
    if class_name:
        owner = getattr(owner, class_name)
    routes = {name: getattr(owner, name) for name in names}
    missing = [name for name, fn in routes.items() if not hasattr(fn, "megatron_fn")]
    if missing:
        raise RuntimeError(f"--without {part}: {where}.{missing} is not routed")
    try:
        for name, fn in routes.items():
            setattr(owner, name, UNFUSED.get(name, fn.megatron_fn))
        yield
    finally:
        for name, fn in routes.items():
            setattr(owner, name, fn)


def without_arms(parts, ppo_update) -> dict:
    """`ppo_update_megatron_<part>`: the `ppo_update` arm's step within `megatron_own`."""
    if parts and ppo_update is None:
        raise SystemExit("--without compares with the ppo_update arm, which this run lacks")

    def arm(part):
        def step():
            with megatron_own(part):
                return ppo_update()

        return step

    return {f"ppo_update_megatron_{part}": arm(part) for part in parts}


PROFILED = ("profiled_s", "kernel_s", "kernel_share", "host_syncs")
FELL_BACK = "compiled_fell_back"


def fell_back() -> dict:
    """{FELL_BACK: the head's compiled functions that failed in this process and ran eager
    since (`vocab_fused.FallBack`)}, or {} where none did: an arm so timed is not the
    compiled kernels' speed."""
    return {FELL_BACK: sorted(set(vocab_fused.FELL_BACK))} if vocab_fused.FELL_BACK else {}


def profiled(name: str, step) -> dict:
    """One `step` under torch.profiler: prints its 30 costliest kernels on a GPU (else its 25
    costliest operators by CPU time) and returns its wall seconds, the seconds the device spent in
    kernels, their share of the wall (low: the host, not the GPU, sets the pace) and the
    number of times the host waited for the device (stream or device synchronisations)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        seconds = timed(step)
    events = prof.key_averages()
    print(f"--- profile of {name}: one step, {seconds:.4f} s ---", flush=True)
    out = {"profiled_s": round(seconds, 4)}
    if not cuda:
        print(events.table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
        return out
    # the kernels' own rows (an operator's row also counts the kernels it launched)
    kernels = sorted(
        (e for e in events if e.device_type == DeviceType.CUDA),
        key=lambda e: -e.self_device_time_total,
    )
    for e in kernels[:30]:
        total = e.self_device_time_total / 1e3
        print(f"{total:9.3f} ms {e.count:6d}x  {e.key[:110]}", flush=True)
    kernel_s = sum(e.self_device_time_total for e in kernels) / 1e6
    out["kernel_s"] = round(kernel_s, 4)
    out["kernel_share"] = round(kernel_s / seconds, 4)
    out["host_syncs"] = sum(e.count for e in events if "Synchronize" in e.key)
    return out


def resident_bytes() -> int:
    """What this process holds now: CUDA memory allocated, else its resident set (VmRSS).
    Also resets the peak that `peak_bytes` reads (Linux: clear_refs 5 resets VmHWM)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    Path("/proc/self/clear_refs").write_text("5")
    return _proc_status_kib("VmRSS") * 1024


def peak_bytes() -> int:
    """The peak since `resident_bytes`: CUDA's max allocated, else the resident set's high
    water mark (VmHWM)."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    return _proc_status_kib("VmHWM") * 1024


def _proc_status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


_TORCHRUN_ENV = {
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
}  # fmt: skip
"""What torchrun sets for its workers (with every TORCHELASTIC_* variable): a child of a
worker that kept them would join that job's rendezvous."""


def arms_alone(argv, names) -> dict[str, dict]:
    """Each arm alone in a child process (same arguments, `--arm`): {arm: {"seconds": its
    median step, "peak_bytes": its peak above what the process held before it built
    anything}}, or {arm: {"error": the child's last line}} when it failed (out of memory)."""
    out = {}
    for name in names:
        child = [sys.executable, "-m", "tools.bench_train_step", *(argv or sys.argv[1:])]
        child = [x for x in child if x not in ("--memory", "--apart")]
        child += ["--arm", name, "--out", ""]
        # a process of its own, not a rank of this job (whose rendezvous port is taken)
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in _TORCHRUN_ENV and not k.startswith("TORCHELASTIC_")
        }
        done = subprocess.run(child, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            out[name] = {"error": last[-500:]}
            continue
        *printed, last = done.stdout.strip().splitlines()
        print("\n".join(printed), flush=True)  # the child's profile tables
        out[name] = json.loads(last)
    return out


def memory_vs_plan(
    arch: ModelArchitecture,
    a,
    ctx,
    measured_bytes: int,
    lora_rank: int = 0,
    logits_checkpointing: bool = False,
) -> dict:
    """The measured peak of this rank next to `tools/plan_memory.py`'s estimate for it."""
    from megatron_rl.memory_plan import GiB, MemoryPlanConfig, plan_memory
    from megatron_rl.models.gpt import transformer_engine_available

    plan = plan_memory(
        arch,
        MemoryPlanConfig(
            tensor_model_parallel_size=a.tp,
            pipeline_model_parallel_size=a.pp,
            data_parallel_size=ctx.dp_size,
            sequence_parallel=a.sequence_parallel,
            use_distributed_optimizer=False,
            micro_batch_size=a.micro_batch_size,
            num_microbatches=a.num_microbatches,
            seq_length=a.seq_length,
            fp8=a.fp8 is not None,
            params_dtype=a.dtype,
            profile="te" if transformer_engine_available() else "local",
            critic=False,
            lora_rank=lora_rank,
            logits_checkpointing=logits_checkpointing,
        ),
    )
    measured = measured_bytes / GiB
    planned = plan.train_bytes / GiB
    return {
        "max_memory_allocated_gib": round(measured, 2),
        "planned_gib": round(planned, 2),
        "planned_over_measured": round(planned / measured, 4),
    }


def _peak_tflops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in DENSE_BF16_PEAK_TFLOPS.items() if k in name), None)


if __name__ == "__main__":
    main()
    exit_now()  # past the interpreter's teardown of torch, megatron and vLLM
