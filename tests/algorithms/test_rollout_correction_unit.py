"""Unit tier: rollout correction (TIS, rejection, veto) and its diagnostics, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algorithms import ppo_policy_loss
from megatron_rl.algorithms.rollout_correction import (
    CorrectionSums,
    RolloutCorrectionConfig,
    compute_rollout_correction,
)

# Two responses; row 0 has 3 response tokens, row 1 has 2 (then padding).
MASK = torch.tensor([[0.0, 1, 1, 1], [0.0, 1, 1, 0]])
LOG_W = torch.tensor([[0.0, 0.1, -0.2, 1.5], [0.0, 0.05, -3.0, 0.0]])  # log pi_old / pi_rollout
ROLLOUT = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-1.0, -1.0, -0.1, -7.0]])
OLD = ROLLOUT + LOG_W
OLD[1, 3] = 99.0  # padding holds anything


def correct(**kw):
    return compute_rollout_correction(OLD, ROLLOUT, MASK, RolloutCorrectionConfig(**kw))


def metrics_of(rc):
    return CorrectionSums.metrics(rc.sums, rc.maxima)


def test_token_tis_truncates_each_token_ratio_at_the_threshold():
    rc = correct(rollout_is="token", rollout_is_threshold=2.0)
    w = [[1.0, math.exp(0.1), math.exp(-0.2), 2.0], [1.0, math.exp(0.05), math.exp(-3.0), 1.0]]
    torch.testing.assert_close(rc.weights, torch.tensor(w))
    assert torch.equal(rc.keep, MASK)  # no rejection configured
    m = metrics_of(rc)
    assert m["rollout_corr/rollout_is_clipped_fraction"] == pytest.approx(1 / 5)
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(math.exp(1.5))
    raw = [math.exp(x) for x in (0.1, -0.2, 1.5, 0.05, -3.0)]
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(sum(raw) / 5)
    ess = sum(raw) ** 2 / (5 * sum(x * x for x in raw))
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(ess)
    assert m["rollout_corr/kl"] == pytest.approx(-(0.1 - 0.2 + 1.5 + 0.05 - 3.0) / 5)
    k3 = sum(math.exp(x) - 1 - x for x in (0.1, -0.2, 1.5, 0.05, -3.0)) / 5
    assert m["rollout_corr/k3_kl"] == pytest.approx(k3)
    assert m["rollout/logprob_gap/max"] == pytest.approx(3.0)
    assert m["rollout/logprob_gap/mean"] == pytest.approx((0.1 + 0.2 + 1.5 + 0.05 + 3.0) / 5)


def test_sequence_tis_gives_every_token_of_a_sequence_its_product_of_ratios():
    rc = correct(rollout_is="sequence", rollout_is_threshold=3.0)
    w0, w1 = math.exp(0.1 - 0.2 + 1.5), math.exp(0.05 - 3.0)
    torch.testing.assert_close(rc.weights[:, 1:3], torch.tensor([[3.0, 3.0], [w1, w1]]))
    assert w0 > 3.0
    assert rc.weights[0, 0] == 1.0 and rc.weights[1, 3] == 1.0  # off the response


def test_a_sequence_weight_bounds_the_sum_of_log_ratios_not_each_token():
    """Log-ratios [25, -24, 0] multiply to e^1: the weight is min(e, C), as documented and
    as verl computes it (bounding each token at 20 first would give e^0 = 1); the token mode
    still bounds each token, and a sum past the bound is bounded once."""
    mask = torch.tensor([[1.0, 1, 1], [1.0, 1, 1]])
    rollout = torch.full((2, 3), -30.0)
    old = rollout + torch.tensor([[25.0, -24.0, 0.0], [25.0, 25.0, 0.0]])
    config = RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=10.0)
    rc = compute_rollout_correction(old, rollout, mask, config)
    torch.testing.assert_close(rc.weights[0], torch.full((3,), math.e))
    torch.testing.assert_close(rc.weights[1], torch.full((3,), 10.0))  # e^50 -> e^20 -> C
    config = RolloutCorrectionConfig(rollout_rs="sequence", rollout_rs_threshold=2.0)
    rc = compute_rollout_correction(old, rollout, mask, config)
    assert rc.keep[:, 0].tolist() == [0.0, 0.0]  # e^1 > 2 and e^50 > 2: both rejected
    config = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=1e9)
    rc = compute_rollout_correction(old, rollout, mask, config)
    torch.testing.assert_close(rc.weights[0, :2], torch.tensor([math.exp(20), math.exp(-20)]))


def test_token_rejection_drops_tokens_outside_the_band_and_counts_them():
    rc = correct(rollout_rs="token", rollout_rs_threshold=2.0)  # band [0.5, 2]
    assert rc.weights is None  # no importance weights asked for
    expected = MASK.clone()
    expected[0, 3] = 0  # w = e^1.5 > 2
    expected[1, 2] = 0  # w = e^-3 < 0.5
    assert torch.equal(rc.keep, expected)
    m = metrics_of(rc)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 5)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == 0.0


@pytest.mark.parametrize(
    "mode, lower, dropped",
    [
        ("sequence", 0.1, [False, True]),  # prod: e^1.4 inside [0.1, 5], e^-2.95 outside
        ("geometric", 0.1, [False, False]),  # per token: e^(1.4/3), e^(-2.95/2) both inside
        ("geometric", 0.5, [False, True]),  # e^-1.475 = 0.23 < 0.5
    ],
)
def test_sequence_rejection_drops_whole_sequences(mode, lower, dropped):
    rc = correct(rollout_rs=mode, rollout_rs_threshold=5.0, rollout_rs_threshold_lower=lower)
    for row, gone in enumerate(dropped):
        assert torch.equal(rc.keep[row], torch.zeros(4) if gone else MASK[row])
    m = metrics_of(rc)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(sum(dropped) / 2)


def test_a_vetoed_token_drops_its_sequence():
    rc = correct(rollout_token_veto_threshold=0.1)  # e^-3 = 0.05 < 0.1 in row 1
    assert torch.equal(rc.keep, torch.stack([MASK[0], torch.zeros(4)]))


def test_agreeing_engines_give_unit_weights_and_zero_diagnostics():
    rc = compute_rollout_correction(
        ROLLOUT, ROLLOUT, MASK, RolloutCorrectionConfig(rollout_is="token")
    )
    torch.testing.assert_close(rc.weights, torch.ones(2, 4))
    m = metrics_of(rc)
    assert m["rollout_corr/rollout_is_mean"] == 1.0 and m["rollout_corr/kl"] == 0.0
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(1.0)


def test_sums_add_over_ranks():
    """Two halves' sums reduced = the whole batch's metrics (what the DP all-reduce relies on)."""
    cfg = RolloutCorrectionConfig(rollout_is="token")
    whole = compute_rollout_correction(OLD, ROLLOUT, MASK, cfg)
    halves = [
        compute_rollout_correction(OLD[i : i + 1], ROLLOUT[i : i + 1], MASK[i : i + 1], cfg)
        for i in (0, 1)
    ]
    sums = halves[0].sums + halves[1].sums
    maxima = torch.maximum(halves[0].maxima, halves[1].maxima)
    assert CorrectionSums.metrics(sums, maxima) == pytest.approx(metrics_of(whole))


def test_weights_times_advantages_equal_weighted_per_token_ppo_losses():
    """The actor applies TIS as w * A; for PPO's clipped surrogate (both signs of A, in and
    out of the clip range, dual clip on) that equals w times each token's loss: with
    asynchronous rollouts, AReaL's decoupled PPO loss (the clipped surrogate against the
    proximal policy times the behaviour weight)."""
    g = torch.Generator().manual_seed(0)
    logprobs = torch.randn(3, 6, generator=g) * 0.3 - 1
    old = logprobs + torch.randn(3, 6, generator=g) * 0.4
    adv = torch.randn(3, 6, generator=g)
    mask = torch.ones(3, 6)
    w = torch.rand(3, 6, generator=g) * 2 + 0.05

    def per_token(a):
        return [
            ppo_policy_loss(
                logprobs[i : i + 1, j : j + 1], old[i : i + 1, j : j + 1], a[i : i + 1, j : j + 1],
                mask[i : i + 1, j : j + 1], clip_eps_low=0.2, clip_eps_high=0.28, dual_clip_c=3.0,
            )[0]
            for i in range(3) for j in range(6)
        ]  # fmt: skip

    plain, weighted = per_token(adv), per_token(adv * w)
    for p, q, wij in zip(plain, weighted, w.flatten().tolist(), strict=True):
        torch.testing.assert_close(q, p * wij)


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"rollout_is": "tokens"}, "rollout_is must be token, sequence or null"),
        ({"rollout_rs": "token"}, "needs rollout_rs_threshold > 1"),
        ({"rollout_rs": "seq", "rollout_rs_threshold": 2.0}, "rollout_rs must be"),
        ({"rollout_rs": "token", "rollout_rs_threshold": 2.0, "rollout_rs_threshold_lower": 1.5}, "lower must be in"),
        ({"rollout_is_threshold": 0.0}, "rollout_is_threshold must be > 0"),
        ({"rollout_token_veto_threshold": 2.0}, "veto_threshold must be in"),
        ({"bypass_mode": True, "rollout_is": "token"}, "pi_old / pi_rollout is 1"),
        ({"bypass_mode": True, "rollout_rs": "token", "rollout_rs_threshold": 2.0}, "bypass_mode"),
        ({"bypass_mode": True, "rollout_token_veto_threshold": 1e-4}, "bypass_mode"),
    ],
)  # fmt: skip
def test_bad_settings_are_refused_by_name(kw, message):
    with pytest.raises(ValueError, match=message):
        RolloutCorrectionConfig(**kw)
