"""Held-out evaluation metrics (pure functions): avg@n and the unbiased pass@k.

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

import torch


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
