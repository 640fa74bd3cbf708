"""How much of the return's variance a critic could explain on a worked-solution task.

    python -m tools.value_ceiling --model runs/demo/tiny-sft-count_on \
        [--data examples/tiny/data/sum_chains_train.jsonl --prompts 128 --n 8]

Samples the policy at temperature 1 as a rollout does, scores each response with the math
reward (`fast`, +1/-1) and finds where it first leaves the row's worked `solution`. Returns
are the trainer's value-pretraining targets (gamma = lambda = 1: the final reward at every
response token) and explained variance is the trainer's statistic (`critic/vf_explained_var`,
over every response token), for three predictors a critic could at best learn, each fit on
the samples themselves (so a ceiling, slightly optimistic):

- `prompt`: each prompt's mean return over its other samples (a critic reading the prompt);
- `departure`: -1 once the response has left the worked solution, else one constant (a
  critic that spots the first wrong token, knowing nothing else);
- `departure+left`: as `departure`, but before leaving it the mean return of the tokens with
  as many gold tokens left (it also knows how far the chain has to go).

A value pretraining that ends far below these has a critic that learned less than it could;
one near them has a task whose returns are mostly not predictable from the prefix.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from megatron_rl.algorithms.losses import explained_variance


def ceiling(returns: list[float], prompt_ids: list[int], departed: list[list[bool]],
            left: list[list[int]]) -> dict[str, float]:  # fmt: skip
    """Explained variance of each ceiling predictor.

    returns: per sample, its final reward; prompt_ids: per sample, its prompt;
    departed[i][t]: sample i's response has left the worked solution before token t;
    left[i][t]: gold tokens left at token t. Token lists are ragged (each response's length).
    """
    width = max(len(d) for d in departed)
    n = len(returns)
    mask = torch.zeros(n, width)
    ret = torch.zeros(n, width)
    gone = torch.zeros(n, width, dtype=torch.bool)
    togo = torch.full((n, width), -1)
    for i, (r, d, k) in enumerate(zip(returns, departed, left, strict=True)):
        mask[i, : len(d)] = 1
        ret[i, : len(d)] = r
        gone[i, : len(d)] = torch.tensor(d)
        togo[i, : len(d)] = torch.tensor(k)
    r = torch.tensor(returns)
    pid = torch.tensor(prompt_ids)
    same = pid[:, None] == pid[None, :]
    others = same.float() - torch.eye(n)
    loo = (others @ r) / others.sum(1).clamp(min=1)  # leave-one-out prompt mean
    valid = mask.bool()
    before = valid & ~gone
    constant = torch.where(gone, torch.tensor(-1.0), ret[before].mean())
    by_left = constant.clone()
    for k in togo[before].unique():
        at = before & (togo == k)
        by_left[at] = ret[at].mean()
    return {
        "prompt": explained_variance(loo[:, None].expand(n, width), ret, mask).item(),
        "departure": explained_variance(constant, ret, mask).item(),
        "departure+left": explained_variance(by_left, ret, mask).item(),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", default="examples/tiny/data/sum_chains_train.jsonl")
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=80)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    from transformers import AutoTokenizer

    from megatron_rl.data import PromptDataConfig, load_prompts
    from megatron_rl.rewards.math_reward import MathVerifierConfig, math_reward
    from megatron_rl.rollout.types import EngineConfig, SamplingConfig
    from megatron_rl.rollout.vllm_engine import VLLMEngine

    tok = AutoTokenizer.from_pretrained(a.model)
    dataset = load_prompts(PromptDataConfig(path=a.data, label_key="solution"), tok)
    rows = [dataset[i] for i in range(min(a.prompts, len(dataset)))]
    lines = Path(a.data).read_text().splitlines()
    answers = [json.loads(line)["answer"] for line in lines]  # what the reward checks
    engine = VLLMEngine(a.model, EngineConfig(seed=a.seed, max_model_len=256))
    sampling = SamplingConfig(n=a.n, temperature=1.0, max_new_tokens=a.max_new_tokens)
    samples = engine.generate([r.prompt_token_ids for r in rows], sampling)
    reward = MathVerifierConfig(backend="fast")
    returns, prompt_ids, departed, left = [], [], [], []
    for s in samples:
        gold = tok(rows[s.prompt_index].label, add_special_tokens=False)["input_ids"]
        gold.append(tok.eos_token_id)
        ids = list(s.token_ids)
        first = next(
            (t for t, (x, g) in enumerate(zip(ids, gold, strict=False)) if x != g), len(gold)
        )
        text = tok.decode(ids, skip_special_tokens=True)
        returns.append(math_reward(text, answers[rows[s.prompt_index].row], reward))
        prompt_ids.append(s.prompt_index)
        departed.append([t > first for t in range(len(ids))])
        left.append([len(gold) - t for t in range(len(ids))])
    evs = ceiling(returns, prompt_ids, departed, left)
    accuracy = sum(r > 0 for r in returns) / len(returns)
    print(json.dumps({"samples": len(returns), "accuracy": round(accuracy, 3),
                      "explained_variance_ceiling": {k: round(v, 3) for k, v in evs.items()}}))  # fmt: skip


if __name__ == "__main__":
    main()
