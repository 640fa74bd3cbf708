"""avg@n and the unbiased pass@k (Chen et al. 2021) against their definitions."""

from __future__ import annotations

from itertools import combinations

import pytest
import torch

from megatron_rl.rollout.evaluation import eval_summary, eval_sums, pass_at_k


def pass_at_k_by_enumeration(n: int, correct: int, k: int) -> float:
    """The share of all k-subsets of the n samples that hold at least one correct sample."""
    samples = [True] * correct + [False] * (n - correct)
    subsets = list(combinations(samples, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_share_of_k_subsets_with_a_correct_sample(n):
    for correct in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, correct, k) == pytest.approx(
                pass_at_k_by_enumeration(n, correct, k), rel=1e-12, abs=1e-12
            ), (n, correct, k)


def test_pass_at_1_is_the_share_correct_and_differs_from_the_biased_estimate():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    # 1 - (1 - c/n)^k draws with replacement: 0.657 for 3 of 10 at k=3; the unbiased 0.708
    assert pass_at_k(10, 3, 3) == pytest.approx(1 - (7 * 6 * 5) / (10 * 9 * 8))
    assert pass_at_k(10, 3, 3) != pytest.approx(1 - 0.7**3, abs=1e-3)


def test_pass_at_k_refuses_k_or_correct_out_of_range():
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="correct must be in"):
        pass_at_k(4, 5, 1)


def test_sums_from_two_ranks_add_up_to_the_summary_of_all_prompts():
    """Each DP rank sums its prompts; the sum of the sums gives the metrics of the whole set."""
    correct = torch.tensor(
        [[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool
    )
    rewards = correct.double() * 2 - 1
    lengths = torch.arange(16, dtype=torch.float64).reshape(4, 4)
    ks = (1, 2, 4)
    whole = eval_summary(4, ks, eval_sums(correct, rewards, lengths, ks))
    halves = eval_sums(correct[:2], rewards[:2], lengths[:2], ks) + eval_sums(
        correct[2:], rewards[2:], lengths[2:], ks
    )
    assert eval_summary(4, ks, halves) == pytest.approx(whole)
    assert whole["prompts"] == 4
    assert whole["avg@4"] == pytest.approx(7 / 16) == whole["pass@1"]
    expected_pass2 = (pass_at_k(4, 1, 2) + 1 + 0 + pass_at_k(4, 2, 2)) / 4
    assert whole["pass@2"] == pytest.approx(expected_pass2)
    assert whole["pass@4"] == pytest.approx(3 / 4)  # prompts with any correct sample
    assert whole["reward_mean"] == pytest.approx(2 * 7 / 16 - 1)
    assert whole["response_length/mean"] == pytest.approx(7.5)


class _Engine:
    """Two samples per prompt: the response is the prompt's ids, then `n` more tokens."""

    multi_turn = False

    def __init__(self):
        self.calls = []

    def generate(self, prompts, sampling, seeds=None):
        from megatron_rl.rollout.types import Sample

        self.calls.append((len(prompts), seeds))
        return [
            Sample(i, j, ids, [7] * (j + 1), [0.0] * (j + 1), "stop")
            for i, ids in enumerate(prompts)
            for j in range(sampling.n)
        ]

    def reset_prefix_cache(self):
        pass


class _Pool:
    """Scores 1 when the response names the label, else 0."""

    def submit(self, inputs):
        return inputs

    def result(self, inputs):
        from types import SimpleNamespace

        rewards = [float(x.label in x.response) for x in inputs]
        return SimpleNamespace(scored=SimpleNamespace(rewards=rewards))


class _Tokenizer:
    def batch_decode(self, ids, skip_special_tokens=True):
        return ["seven" if len(x) == 1 else "eight" for x in ids]


def test_the_evaluator_scores_each_prompts_samples_with_that_prompts_label(monkeypatch):
    """Reward inputs come from the rollout's `reward_inputs`: each sample with its own
    prompt's label, also across the engine calls a set is split into."""
    from types import SimpleNamespace

    from megatron_rl.config import EvalSetConfig
    from megatron_rl.rollout import evaluation
    from megatron_rl.rollout.evaluation import Evaluator

    monkeypatch.setattr(evaluation, "data_parallel_sum", lambda t: t)  # one rank, no group

    prompts = [
        SimpleNamespace(prompt=f"p{i}", prompt_text=f"p{i}", label=label, prompt_token_ids=[i])
        for i, label in enumerate(["seven", "eight", "nine"])  # the last: in the second call
    ]
    spec = EvalSetConfig(path="x.jsonl", name="s", n=2, temperature=1.0, pass_k=(1, 2))
    engine = _Engine()
    evaluator = Evaluator(
        sets=[(spec, prompts)], engine=engine, pool=_Pool(), tokenizer=_Tokenizer(), seed=0,
        dp_rank=0, dp_size=1, device=torch.device("cpu"), max_new_tokens=8, max_sequences=4,
    )  # fmt: skip
    metrics, rows = evaluator.evaluate(step=3)
    assert [n for n, _ in engine.calls] == [2, 1]  # 4 sequences at a time: 2 prompts x n 2
    assert metrics["eval/s/avg@2"] == metrics["eval/accuracy"] == pytest.approx(1 / 3)
    assert metrics["eval/s/pass@2"] == pytest.approx(2 / 3)
    assert rows == [{"set": "s", "n": 2, "temperature": 1.0, **{
        "prompts": 3, "avg@2": pytest.approx(1 / 3), "pass@1": pytest.approx(1 / 3),
        "pass@2": pytest.approx(2 / 3), "reward_mean": pytest.approx(1 / 3),
        "response_length/mean": 1.5}}]  # fmt: skip
