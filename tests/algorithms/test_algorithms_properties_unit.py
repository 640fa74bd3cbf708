"""Unit tier, property-based (hypothesis): invariants of the estimators and losses."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.algorithms import (
    ADV_ESTIMATORS,
    AdvantageConfig,
    AdvantageInputs,
    clipped_value_loss,
    positive_sample_nll_loss,
    ppo_policy_loss,
)
from tests.algorithms.test_algorithms_unit import random_batch, random_policy_batch

LOSS_MODES = st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])


def garbage_on_padding(
    x: torch.Tensor, mask: torch.Tensor, seed: int, scale: float
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    noise = (torch.rand(x.shape, generator=g, dtype=x.dtype) - 0.5) * 2 * scale
    return torch.where(mask.bool(), x, noise)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    holes=st.booleans(),
    name=st.sampled_from(sorted(ADV_ESTIMATORS)),
    scale=st.floats(1.0, 1e4),
    kl_coef=st.sampled_from([0.0, 0.1]),
    alpha=st.sampled_from([None, 0.05, 0.5]),
)
def test_padding_never_changes_advantages(seed, holes, name, scale, kl_coef, alpha):
    b = random_batch(seed, holes)
    cfg = AdvantageConfig(kl_coef=kl_coef, length_adaptive_alpha=alpha)
    clean = ADV_ESTIMATORS[name](AdvantageInputs(**b), cfg)
    mask = b["response_mask"]
    dirty = {
        **b,
        "values": garbage_on_padding(b["values"], mask, seed, scale),
        "token_kl": garbage_on_padding(b["token_kl"], mask, seed + 1, scale),
    }
    noisy = ADV_ESTIMATORS[name](AdvantageInputs(**dirty), cfg)
    assert torch.equal(clean.advantages, noisy.advantages)
    assert torch.equal(clean.returns, noisy.returns)
    assert (clean.advantages[mask == 0] == 0).all()


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    mode=LOSS_MODES,
    dual=st.sampled_from([None, 3.0]),
    scale=st.floats(1.0, 50.0),
)
def test_padding_never_changes_losses_or_their_gradients(seed, mode, dual, scale):
    logp, old, adv, mask, scores = random_policy_batch(seed)
    values, returns = torch.randn_like(adv), torch.randn_like(adv)

    def losses(lp, o, a, v, r):
        lp = lp.clone().requires_grad_()
        pg, _ = ppo_policy_loss(lp, o, a, mask, dual_clip_c=dual, loss_agg_mode=mode)
        nll = positive_sample_nll_loss(lp, mask, scores)
        vf, _ = clipped_value_loss(v, v * 0.5, r, mask, loss_agg_mode=mode)
        (pg + nll).backward()
        return torch.stack([pg, nll, vf]).detach(), lp.grad[mask.bool()]

    clean, clean_grad = losses(logp, old, adv, values, returns)
    noisy, noisy_grad = losses(
        *(
            garbage_on_padding(x, mask, seed + i, scale)
            for i, x in enumerate((logp, old, adv, values, returns))
        )
    )
    assert torch.equal(clean, noisy)
    assert torch.equal(clean_grad, noisy_grad)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    lo=st.floats(0.0, 0.5),
    hi=st.floats(0.0, 0.5),
    dual=st.sampled_from([None, 3.0]),
)
def test_ratio_one_gives_minus_mean_advantage(seed, lo, hi, dual):
    _, old, adv, mask, _ = random_policy_batch(seed)
    loss, metrics = ppo_policy_loss(
        old.clone(), old, adv, mask, clip_eps_low=lo, clip_eps_high=hi, dual_clip_c=dual
    )
    expected = -(adv * mask).sum() / mask.sum().clamp(min=1)
    assert torch.allclose(loss, expected, atol=1e-12)
    assert metrics["pg_clipfrac"] == 0
