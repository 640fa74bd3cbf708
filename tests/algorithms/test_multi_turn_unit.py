"""Unit tier: multi-turn samples in the batch and the estimators. Environment tokens
sit in the sequence and out of the response mask; every estimator treats them as absent
(GAE with holes = GAE with those columns deleted); step rewards land on policy tokens; the
log-prob gap is counted per turn."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.algorithms import AdvantageConfig, AdvantageInputs, get_adv_estimator
from megatron_rl.algorithms.losses import clipped_value_loss
from megatron_rl.algorithms.rollout_correction import (
    GAP_TURNS,
    RolloutCorrectionConfig,
    compute_rollout_correction,
    diagnostics_metrics,
    pack_diagnostics,
    turn_gap_metrics,
    turn_gap_sums,
)
from megatron_rl.data.batch import (
    engine_logprobs_of,
    samples_to_batch,
    step_rewards_of,
    turn_index_of,
)
from megatron_rl.rollout.types import Sample
from tests.tolerances import assert_close

DTYPE = torch.float64
F64 = {"rtol": 1e-12, "atol": 1e-12}
"""float64 maths done in another order (whitening sums over other positions)."""


def sample(prompt: int, response: int, spans=(), step_rewards=(), index: int = 0) -> Sample:
    """A sample with `prompt` prompt tokens, `response` response tokens (ids 10, 11, ...),
    environment blocks `spans` (log-prob 0.0 there, as the engine reports them)."""
    tokens = list(range(10, 10 + response))
    logprobs = [-0.1 * (t + 1) for t in range(response)]
    for a, b in spans:
        logprobs[a:b] = [0.0] * (b - a)
    return Sample(
        prompt_index=index, sample_index=0, prompt_token_ids=[1] * prompt, token_ids=tokens,
        logprobs=logprobs, finish_reason="stop", env_spans=list(spans),
        step_rewards=list(step_rewards),
    )  # fmt: skip


SAMPLES = [
    sample(3, 10, spans=[(3, 6)], step_rewards=[(2, 0.5)]),  # turn 0: 0-2, env 3-5, turn 1: 6-9
    sample(2, 4),  # single turn
    sample(4, 12, spans=[(2, 4), (6, 9)], index=1),  # turns 0-1, 4-5, 9-11
]


def test_environment_tokens_are_in_the_sequence_and_out_of_the_response_mask():
    batch = samples_to_batch(SAMPLES)
    assert batch.input_ids[0, :13].tolist() == [1] * 3 + list(range(10, 20))
    assert batch.response_mask[0].tolist() == [0] * 3 + [1] * 3 + [0] * 3 + [1] * 4 + [0] * 3
    assert batch.response_mask[1].tolist() == [0, 0] + [1] * 4 + [0] * 10
    assert batch.response_mask[2].tolist() == [0] * 4 + [1, 1, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1]
    # the sequence still ends at the last policy token, which is the last token
    assert batch.sequence_lengths().tolist() == [13, 6, 16]
    turns = turn_index_of(SAMPLES, batch)
    assert turns[0].tolist() == [-1] * 3 + [0] * 6 + [1] * 4 + [-1] * 3
    assert turns[1].tolist() == [-1] * 2 + [0] * 4 + [-1] * 10
    assert turns[2].tolist() == [-1] * 4 + [0] * 4 + [1] * 5 + [2] * 3


def test_engine_logprobs_and_step_rewards_land_on_policy_tokens_only():
    batch = samples_to_batch(SAMPLES)
    engine = engine_logprobs_of(SAMPLES, batch)
    assert (engine[batch.response_mask == 0] == 0).all()
    assert engine[0, 3:6].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert engine[0, 9:13].tolist() == pytest.approx([-0.7, -0.8, -0.9, -1.0])
    rewards = step_rewards_of(SAMPLES, batch)
    assert rewards.dtype == DTYPE and rewards.sum().item() == 0.5 and rewards[0, 5].item() == 0.5
    assert step_rewards_of(SAMPLES[1:], samples_to_batch(SAMPLES[1:])) is None


@pytest.mark.parametrize(
    "spans, why",
    [
        ([(0, 2)], "before the first policy token"),
        ([(3, 10)], "up to the last token"),
        ([(5, 7), (2, 4)], "out of order"),
        ([(3, 3)], "empty"),
    ],
)
def test_a_malformed_environment_span_is_refused_naming_the_sample(spans, why):
    bad = sample(3, 10, spans=spans)
    with pytest.raises(ValueError, match=r"sample 1: environment span"):
        samples_to_batch([SAMPLES[1], bad])


def test_a_step_reward_on_an_environment_token_is_refused():
    bad = sample(3, 10, spans=[(3, 6)], step_rewards=[(4, 1.0)])
    with pytest.raises(ValueError, match=r"sample 0: step reward 1.0 at response token 4"):
        step_rewards_of([bad], samples_to_batch([bad]))


# ------------------------------------------------------------------------ the estimators


def random_multi_turn(seed: int, rows: int = 6, length: int = 14):
    """[B, T] response mask with holes (environment blocks) and right padding, values, KL,
    scores and step rewards on policy tokens; groups of 3."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, length, dtype=DTYPE)
    for i in range(rows):
        n = int(torch.randint(4, length + 1, (1,), generator=g))
        mask[i, :n] = 1
        a = int(torch.randint(1, n - 2, (1,), generator=g))
        b = int(torch.randint(a + 1, n - 1, (1,), generator=g))
        mask[i, a:b] = 0  # an environment block inside the response
    step = torch.randn(rows, length, generator=g, dtype=DTYPE)
    step = torch.where((torch.rand(rows, length, generator=g) < 0.2) & mask.bool(), step, 0)
    return AdvantageInputs(
        scores=torch.randn(rows, generator=g, dtype=DTYPE),
        response_mask=mask,
        values=torch.randn(rows, length, generator=g, dtype=DTYPE),
        group_index=torch.arange(rows) // 3,
        token_kl=torch.randn(rows, length, generator=g, dtype=DTYPE).abs(),
        step_rewards=step,
    )


def without_holes(inputs: AdvantageInputs) -> tuple[AdvantageInputs, list[torch.Tensor]]:
    """Each row with its environment columns deleted (policy tokens packed left), and the
    kept column indices of each row."""
    rows, length = inputs.response_mask.shape
    kept = [torch.nonzero(inputs.response_mask[i]).flatten() for i in range(rows)]

    def pack(x):
        out = torch.zeros(rows, length, dtype=x.dtype)
        for i, k in enumerate(kept):
            out[i, : len(k)] = x[i, k]
        return out

    mask = torch.zeros_like(inputs.response_mask)
    for i, k in enumerate(kept):
        mask[i, : len(k)] = 1
    packed = AdvantageInputs(
        scores=inputs.scores, response_mask=mask, values=pack(inputs.values),
        group_index=inputs.group_index, token_kl=pack(inputs.token_kl),
        step_rewards=pack(inputs.step_rewards),
    )  # fmt: skip
    return packed, kept


@pytest.mark.parametrize(
    "config",
    [
        AdvantageConfig("gae", lambda_policy=0.95, lambda_critic=1.0, kl_coef=0.1),
        AdvantageConfig("gae", lambda_policy=1.0, lambda_critic=1.0, gamma=0.99),
        AdvantageConfig("gae", length_adaptive_alpha=0.3, kl_coef=0.05),
        AdvantageConfig("reinforce_plus_plus", kl_coef=0.1, gamma=0.99),
        AdvantageConfig("reinforce_plus_plus_baseline"),
        AdvantageConfig("grpo"),
        AdvantageConfig("rloo"),
    ],
    ids=lambda c: c.estimator + ("-adaptive" if c.length_adaptive_alpha else ""),
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_estimator_treats_environment_tokens_as_absent(config, seed):
    """The advantages and returns on policy tokens equal those of the same rows with the
    environment columns deleted, and are 0 on the environment's tokens: no reward, value,
    discount or lambda decay happens across an environment block (verl PR #2337)."""
    inputs = random_multi_turn(seed)
    packed, kept = without_holes(inputs)
    estimator = get_adv_estimator(config.estimator)
    out, ref = estimator(inputs, config), estimator(packed, config)
    env = inputs.response_mask == 0
    for name in ("advantages", "returns", "raw_advantages"):
        got, want = getattr(out, name), getattr(ref, name)
        assert (got[env] == 0).all(), name
        for i, k in enumerate(kept):
            assert_close(got[i, k], want[i, : len(k)], F64)


def test_step_rewards_count_where_they_happen_for_gae_and_in_the_total_for_groups():
    inputs = random_multi_turn(3)
    assert inputs.step_rewards.abs().sum() > 0
    plain = AdvantageInputs(**{**inputs.__dict__, "step_rewards": None})
    config = AdvantageConfig("gae", lambda_policy=1.0, lambda_critic=1.0, whiten_advantages=False)
    with_steps, without = (get_adv_estimator("gae")(x, config) for x in (inputs, plain))
    # lambda = gamma = 1: the return at a token grows by the step rewards at or after it
    later = inputs.step_rewards.flip(1).cumsum(1).flip(1)
    mask = inputs.response_mask.bool()
    assert_close(with_steps.returns[mask], (without.returns + later)[mask], F64)
    grpo = get_adv_estimator("grpo")(inputs, AdvantageConfig("grpo", grpo_norm_by_std=False))
    total = inputs.scores + inputs.step_rewards.sum(1)
    group_mean = total.view(-1, 3).mean(1).repeat_interleave(3)
    first = torch.nonzero(inputs.response_mask[:, 0]).flatten()
    assert_close(grpo.advantages[first, 0], (total - group_mean)[first], F64)
    baseline = get_adv_estimator("reinforce_plus_plus_baseline")(
        inputs, AdvantageConfig("reinforce_plus_plus_baseline")
    )
    assert_close(baseline.returns[first, 0], (total - group_mean)[first], F64)


def test_step_rewards_off_the_policy_tokens_are_refused():
    inputs = random_multi_turn(0)
    step = inputs.step_rewards.clone()
    step[inputs.response_mask == 0] = 1.0
    bad = AdvantageInputs(**{**inputs.__dict__, "step_rewards": step})
    with pytest.raises(ValueError, match="step_rewards must be 0 off the response mask"):
        get_adv_estimator("gae")(bad, AdvantageConfig())


def test_the_value_loss_has_no_gradient_at_environment_tokens():
    inputs = random_multi_turn(4)
    values = inputs.values.clone().requires_grad_()
    returns = get_adv_estimator("gae")(inputs, AdvantageConfig()).returns
    loss, _ = clipped_value_loss(values, inputs.values, returns, inputs.response_mask)
    loss.backward()
    env = inputs.response_mask == 0
    assert (values.grad[env] == 0).all() and (values.grad[~env] != 0).any()


# ------------------------------------------------------------------ the gap per turn


def test_the_logprob_gap_is_counted_per_turn_and_later_turns_pooled():
    turn = torch.tensor([[-1, 0, 0, 0, 1, 1, -1], [-1, -1, 0, 1, 2, 9, 8]])
    mask = torch.tensor([[0, 1, 1, 0, 1, 1, 0], [0, 0, 1, 1, 1, 1, 1]])
    old = torch.zeros(2, 7)
    engine = -torch.tensor(
        [[5.0, 0.1, 0.3, 9.0, 0.2, 0.4, 7.0], [3.0, 3.0, 0.5, 0.6, 0.7, 0.8, 1.0]]
    )
    sums, maxima = turn_gap_sums(old, engine, mask, turn)
    assert sums.shape == (GAP_TURNS, 2) and maxima.shape == (GAP_TURNS,)
    metrics = turn_gap_metrics(sums, maxima)
    expected = {0: (0.9 / 3, 0.5), 1: (1.2 / 3, 0.6), 2: (0.7, 0.7), GAP_TURNS - 1: (0.9, 1.0)}
    assert set(metrics) == {
        f"rollout/logprob_gap/turn_{k}/{s}" for k in expected for s in ("mean", "max")
    }
    for k, (mean, top) in expected.items():
        assert metrics[f"rollout/logprob_gap/turn_{k}/mean"] == pytest.approx(mean)
        assert metrics[f"rollout/logprob_gap/turn_{k}/max"] == pytest.approx(top)


@pytest.mark.parametrize("samples", [SAMPLES, SAMPLES[1:2]], ids=["multi-turn", "single-turn"])
def test_the_per_turn_gap_is_reported_with_the_batch_diagnostics_when_a_second_turn_exists(
    samples,
):
    """What the experience maker logs: the batch's gap over policy tokens only (environment
    tokens' placeholder log-probs never count), and per turn once some sample has two."""
    batch = samples_to_batch(samples)
    engine = engine_logprobs_of(samples, batch)
    old = engine - 0.01 * turn_index_of(samples, batch).clamp(min=0) - 0.001 * batch.response_mask
    old = torch.where(batch.response_mask.bool(), old, -5.0)  # junk off the policy tokens
    rc = compute_rollout_correction(old, engine, batch.response_mask, RolloutCorrectionConfig())
    turns = turn_gap_sums(old, engine, batch.response_mask, turn_index_of(samples, batch))
    metrics = diagnostics_metrics(*pack_diagnostics(rc, *turns))
    policy = batch.response_mask.bool()
    gap = (old - engine).abs()[policy]
    assert metrics["rollout/logprob_gap/mean"] == pytest.approx(gap.mean().item())
    assert metrics["rollout/logprob_gap/max"] == pytest.approx(gap.max().item())
    per_turn = {k for k in metrics if "/turn_" in k}
    if len(samples) == 1:
        assert per_turn == set()
    else:  # turns 0, 1, 2: gaps 0.001, 0.011, 0.021
        assert len(per_turn) == 6
        for k, want in enumerate([0.001, 0.011, 0.021]):
            assert metrics[f"rollout/logprob_gap/turn_{k}/mean"] == pytest.approx(want, rel=1e-4)
