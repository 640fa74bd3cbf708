"""A simulation, not a measurement: PPO steps per hour of a recipe's shape at GPU scale,
with the engines colocated, apart and synchronous, and apart one step off. It exists
because the overlap async RL buys is a GPU property these CPU machines cannot show
(`tools.bench async` measures the tiny demo here).

    python -m tools.async_sim [--recipe examples/qwen2.5-32b/vapo.yaml --gpus 128
        --median-response 3000 --sigma 1.0 --mfu 0.17 ...]

The model, all of it stated in the output:
- responses: `rollout_batch_size x n_samples_per_prompt` lengths drawn lognormal (median,
  sigma), capped at `max_new_tokens`; every prompt `--prompt-tokens` long;
- generation: engines of vLLM TP t (the recipe's), sequences dealt round-robin, continuous
  batching up to the concurrency the KV cache allows; a decode step of an engine reads its
  weights and its running sequences' KV once (HBM roofline) or is compute-bound (2 x params
  FLOPs per token at `--decode-mfu`), whichever is slower; prompts prefill at `--mfu`;
  the step waits for the slowest engine: the long tail;
- training: tokens x params x (6 per trained model per epoch + 2 per forward of the
  experience: old log-probs, values, reference) / (training GPUs x peak x `--mfu`; the
  default 0.17 is the bf16 PPO update measured on one H200, bench/gpu.md);
- weights: colocated, a sync plus the engine's sleep and wake (`--colocated-switch-s`);
  apart, a push of the bf16 weights at `--push-gb-s`;
- a step: colocated gen(all GPUs) + train(all) + switch; apart, synchronous,
  gen(E) + train(G - E) + push; one step off, max(gen(E), train(G - E) + push), its steady
  state; fully async with partial rollouts (`simulate_partial`), the engines generate all
  batches as one stream (no tail per step) and pay each push plus a re-prefill of their
  running sequences. E (GPUs that generate) is searched over multiples of the engine size
  that leave the trainers a multiple of TP x PP.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
from dataclasses import dataclass

from megatron_rl.config import load_config
from megatron_rl.models.presets import param_count, resolve_arch


@dataclass(frozen=True)
class Hardware:
    peak_flops: float = 989e12
    """bf16 dense, H100 SXM."""
    hbm_bytes_s: float = 3.35e12
    hbm_efficiency: float = 0.6
    """The share of HBM bandwidth a decode step reaches (vLLM at large batch: ~0.5-0.7)."""
    gpu_bytes: float = 80e9
    kv_memory_fraction: float = 0.8
    """vLLM's gpu_memory_utilization: weights and KV cache within it."""
    mfu: float = 0.17
    decode_mfu: float = 0.5
    push_bytes_s: float = 25e9
    colocated_switch_s: float = 20.0


@dataclass(frozen=True)
class Engine:
    """One vLLM engine of `tp` GPUs serving a model of `params` (bf16) parameters."""

    params: int
    kv_bytes_per_token: int
    tp: int
    max_num_seqs: int = 256

    def concurrency(self, hw: Hardware, mean_context: float) -> int:
        budget = self.tp * hw.gpu_bytes * hw.kv_memory_fraction - 2 * self.params
        per_sequence = self.kv_bytes_per_token * mean_context
        if per_sequence <= 0:
            return self.max_num_seqs
        return max(1, min(self.max_num_seqs, int(budget / per_sequence)))

    def time(self, responses: list[int], prompt_tokens: int, hw: Hardware) -> float:
        """Seconds to generate `responses` (lengths) with continuous batching: event-driven,
        a block of decode steps at a time (until the next sequence finishes)."""
        if not responses:
            return 0.0
        bandwidth = self.tp * hw.hbm_bytes_s * hw.hbm_efficiency
        weights_s = 2 * self.params / bandwidth
        kv_s = self.kv_bytes_per_token / bandwidth  # per token of context read, per step
        flops_s = 2 * self.params / (self.tp * hw.peak_flops * hw.decode_mfu)  # per sequence
        prefill_s = 2 * self.params * prompt_tokens / (self.tp * hw.peak_flops * hw.mfu)
        cap = self.concurrency(hw, prompt_tokens + sum(responses) / len(responses))
        waiting = list(responses)
        running: list[tuple[int, int]] = []  # (finish step, start step)
        now, step, context = 0.0, 0, 0  # context: KV tokens of the running sequences
        while waiting or running:
            while waiting and len(running) < cap:
                length = waiting.pop()
                heapq.heappush(running, (step + length, step))
                context += prompt_tokens
                now += prefill_s
            finish = running[0][0]
            k, n = finish - step, len(running)
            # over k steps the context grows by n tokens a step
            memory = k * weights_s + kv_s * (k * context + n * k * (k - 1) / 2)
            now += max(memory, k * n * flops_s)
            context += n * k
            step = finish
            while running and running[0][0] == step:
                _, start = heapq.heappop(running)
                context -= prompt_tokens + (step - start)
        return now


def generation_s(lengths, gpus, engine, prompt_tokens, hw) -> float:
    """The slowest engine's time when `gpus` GPUs (engines of engine.tp) share the
    sequences round-robin."""
    engines = gpus // engine.tp
    shares = [lengths[e::engines] for e in range(engines)]
    return max(engine.time(share, prompt_tokens, hw) for share in shares)


def training_s(tokens: int, params: int, passes: float, gpus: int, hw: Hardware) -> float:
    return tokens * params * passes / (gpus * hw.peak_flops * hw.mfu)


def splits(gpus: int, engine: Engine, trainer_unit: int):
    """(engines' GPUs, trainers' GPUs) of every split: whole engines, and trainers in
    multiples of TP x PP."""
    for gen_gpus in range(engine.tp, gpus, engine.tp):
        if (gpus - gen_gpus) % trainer_unit == 0:
            yield gen_gpus, gpus - gen_gpus


def simulate(
    lengths: list[int],
    gpus: int,
    engine: Engine,
    trainer_unit: int,
    prompt_tokens: int,
    passes: float,
    hw: Hardware,
) -> dict:
    """Seconds per step of each mode (apart: at its best split) for one batch of lengths."""
    tokens = sum(lengths) + prompt_tokens * len(lengths)
    push_s = 2 * engine.params / hw.push_bytes_s
    all_gen = generation_s(lengths, gpus, engine, prompt_tokens, hw)
    all_train = training_s(tokens, engine.params, passes, gpus, hw)
    colocated = all_gen + all_train + hw.colocated_switch_s
    best = {"sync": (math.inf, 0), "one_step_off": (math.inf, 0)}
    for gen_gpus, train_gpus in splits(gpus, engine, trainer_unit):
        gen = generation_s(lengths, gen_gpus, engine, prompt_tokens, hw)
        train = training_s(tokens, engine.params, passes, train_gpus, hw) + push_s
        for mode, step in (("sync", gen + train), ("one_step_off", max(gen, train))):
            best[mode] = min(best[mode], (step, gen_gpus))
    return {"colocated": (colocated, gpus), **best, "phases": (all_gen, all_train)}


def simulate_partial(
    batches: list[list[int]],
    gpus: int,
    engine: Engine,
    trainer_unit: int,
    prompt_tokens: int,
    passes: float,
    hw: Hardware,
) -> tuple[float, int]:
    """Seconds per step, and the engines' GPUs, of fully async RL with partial rollouts
    (AReaL's interruptible generation; verl's fully async recipe), at its best split.

    The engines never wait for a round's tail: the next step's prompts fill the batch slots
    the tail leaves idle, and a push reaches them mid-generation. So each engine works
    through one stream of all `batches` (its tail paid once, not once a step), and each
    step's push costs the engines the push itself plus the re-prefill of every running
    sequence (its KV cache was made by the old weights): a full cache's worth of tokens,
    `concurrency x (prompt + mean response)`, prefilled at `hw.mfu`. The trainers train and
    push; the step is the slower of the two sides, their steady state when the staleness
    bound lets the engines run ahead."""
    n = len(batches)
    lengths = [length for batch in batches for length in batch]
    tokens = sum(lengths) / n + prompt_tokens * len(lengths) / n
    push_s = 2 * engine.params / hw.push_bytes_s
    mean_context = prompt_tokens + sum(lengths) / len(lengths)
    cached = engine.concurrency(hw, mean_context) * mean_context
    reprefill_s = 2 * engine.params * cached / (engine.tp * hw.peak_flops * hw.mfu)
    best = (math.inf, 0)
    for gen_gpus, train_gpus in splits(gpus, engine, trainer_unit):
        gen = generation_s(lengths, gen_gpus, engine, prompt_tokens, hw) / n
        train = training_s(tokens, engine.params, passes, train_gpus, hw)
        best = min(best, (max(gen + push_s + reprefill_s, train + push_s), gen_gpus))
    return best


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="examples/qwen2.5-32b/vapo.yaml")
    p.add_argument("--model", default="qwen2.5-32b", help="a preset or a config.json path")
    p.add_argument("--gpus", type=int, default=128, help="16 nodes of 8: the recipe's sbatch")
    p.add_argument("--median-response", type=float, default=3000.0)
    p.add_argument("--sigma", type=float, default=1.0, help="of log(response length)")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--batches", type=int, default=3, help="batches of lengths averaged")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mfu", type=float, default=Hardware.mfu)
    p.add_argument("--hbm-efficiency", type=float, default=Hardware.hbm_efficiency)
    p.add_argument("--push-gb-s", type=float, default=Hardware.push_bytes_s / 1e9)
    p.add_argument("--colocated-switch-s", type=float, default=Hardware.colocated_switch_s)
    a = p.parse_args(argv)
    c = load_config(a.recipe)
    arch = resolve_arch(a.model)
    hw = Hardware(
        mfu=a.mfu,
        hbm_efficiency=a.hbm_efficiency,
        push_bytes_s=a.push_gb_s * 1e9,
        colocated_switch_s=a.colocated_switch_s,
    )
    kv_per_token = 2 * arch.num_layers * arch.num_query_groups * arch.head_dim * 2  # K, V, bf16
    r, par = c.rollout, c.parallel
    engine = Engine(param_count(arch), kv_per_token, r.vllm_tensor_parallel_size or 1)
    trainer_unit = par.tensor_model_parallel_size * par.pipeline_model_parallel_size
    # per token: 6 x params per trained model per epoch, 2 per experience forward
    trained = 1 + c.use_critic
    forwards = 1 + c.use_critic + c.use_reference
    passes = 6 * trained * c.actor.ppo_epochs + 2 * forwards
    rng = random.Random(a.seed)
    n = r.rollout_batch_size * r.n_samples_per_prompt
    batches = [
        [
            min(
                r.max_new_tokens,
                max(1, round(rng.lognormvariate(math.log(a.median_response), a.sigma))),
            )
            for _ in range(n)
        ]
        for _ in range(a.batches)
    ]
    runs = [
        simulate(lengths, a.gpus, engine, trainer_unit, a.prompt_tokens, passes, hw)
        for lengths in batches
    ]
    phases = [run.pop("phases") for run in runs]
    partial = simulate_partial(batches, a.gpus, engine, trainer_unit, a.prompt_tokens, passes, hw)
    for run in runs:  # one stream over every batch: the same value for each
        run["fully_async_partial"] = partial
    modes = {}
    for mode in runs[0]:
        seconds = sum(run[mode][0] for run in runs) / len(runs)
        splits = sorted({run[mode][1] for run in runs})
        modes[mode] = {"step_s": round(seconds, 1), "steps_per_hour": round(3600 / seconds, 2),
                       "generation_gpus": splits}  # fmt: skip
    base = modes["colocated"]["step_s"]
    for m in modes.values():
        m["speedup_vs_colocated"] = round(base / m["step_s"], 2)
    out = {
        "what": "a simulation (tools/async_sim.py), not a measurement",
        "recipe": a.recipe, "model": a.model, "params_b": round(engine.params / 1e9, 1),
        "gpus": a.gpus, "sequences_per_step": n,
        "response_lengths": f"lognormal median {a.median_response:.0f}, sigma {a.sigma}, "
                            f"cap {r.max_new_tokens}",
        "hardware": {"peak_tflops": hw.peak_flops / 1e12, "hbm_tb_s": hw.hbm_bytes_s / 1e12,
                     "hbm_efficiency": hw.hbm_efficiency, "mfu": hw.mfu,
                     "push_gb_s": hw.push_bytes_s / 1e9,
                     "colocated_switch_s": hw.colocated_switch_s},
        # on all the GPUs: what the overlap has to work with
        "generation_s_all_gpus": round(sum(g for g, _ in phases) / len(phases), 1),
        "training_s_all_gpus": round(sum(t for _, t in phases) / len(phases), 1),
        **modes,
    }  # fmt: skip
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
