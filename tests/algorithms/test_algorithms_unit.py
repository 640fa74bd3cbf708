"""Unit tier: advantage estimators, KL and losses against slow references and closed forms."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algorithms import (
    AdvantageConfig,
    AdvantageInputs,
    Moments,
    aggregate_loss,
    clipped_value_loss,
    entropy_from_logits,
    explained_variance,
    explained_variance_of,
    get_adv_estimator,
    kl_estimate,
    kl_penalized_token_rewards,
    length_adaptive_lambda,
    masked_whiten,
    positive_sample_nll_loss,
    ppo_policy_loss,
    token_and_sequence_counts,
)
from tests import algorithms_reference as ref

DTYPE = torch.float64


def random_batch(seed: int, holes: bool = False, max_len: int = 12):
    """Groups of G samples for P prompts, random right-padded lengths (with a length-1 row
    and an all-masked row), optional holes, shuffled so groups are interleaved."""
    g = torch.Generator().manual_seed(seed)
    G = int(torch.randint(2, 5, (1,), generator=g))
    P = int(torch.randint(1, 4, (1,), generator=g))
    B, T = G * P, int(torch.randint(1, max_len + 1, (1,), generator=g))
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0], lengths[-1] = 1, 0
    mask = (torch.arange(T)[None] < lengths[:, None]).to(DTYPE)
    if holes:
        mask = mask * (torch.rand(B, T, generator=g) > 0.25)
    perm = torch.randperm(B, generator=g)
    return dict(
        scores=torch.randn(B, generator=g, dtype=DTYPE)[perm],
        response_mask=mask[perm],
        values=torch.randn(B, T, generator=g, dtype=DTYPE),
        token_kl=torch.rand(B, T, generator=g, dtype=DTYPE) * 0.2,
        group_index=torch.arange(P).repeat_interleave(G)[perm],
    )


def as_lists(batch):
    return {k: v.tolist() for k, v in batch.items()}


def assert_close(actual: torch.Tensor, expected, tol=1e-9):
    expected = torch.tensor(expected, dtype=DTYPE)
    assert actual.shape == expected.shape
    assert torch.allclose(actual.to(DTYPE), expected, atol=tol, rtol=tol), (actual, expected)


GAE_CONFIGS = [
    AdvantageConfig(lambda_policy=0.95, lambda_critic=1.0),
    AdvantageConfig(lambda_policy=0.9, lambda_critic=0.8, gamma=0.99, whiten_advantages=False),
    AdvantageConfig(length_adaptive_alpha=0.05),  # lengths <= 12: lambda_policy everywhere
    AdvantageConfig(length_adaptive_alpha=0.3, whiten_advantages=False),  # lambda in (0, 1)
    AdvantageConfig(kl_coef=0.1, lambda_policy=0.95),
]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize(
    "cfg",
    GAE_CONFIGS,
    ids=lambda c: f"lp{c.lambda_policy}-a{c.length_adaptive_alpha}-kl{c.kl_coef}",
)
@pytest.mark.parametrize("holes", [False, True])
def test_gae_matches_reference(seed, cfg, holes):
    b = random_batch(seed, holes)
    out = get_adv_estimator("gae")(AdvantageInputs(**b), cfg)
    adv, ret = ref.gae_reference(
        b["scores"].tolist(),
        b["values"].tolist(),
        b["response_mask"].tolist(),
        b["token_kl"].tolist(),
        cfg,
    )
    assert_close(out.advantages, adv, tol=1e-7)
    assert_close(out.returns, ret)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_matches_reference(seed, norm_by_std):
    b = random_batch(seed)
    cfg = AdvantageConfig(estimator="grpo", grpo_norm_by_std=norm_by_std)
    out = get_adv_estimator("grpo")(AdvantageInputs(**b), cfg)
    lists = as_lists(b)
    expected = ref.grpo_reference(
        lists["scores"], lists["response_mask"], lists["group_index"], cfg.eps, norm_by_std
    )
    assert_close(out.advantages, expected)


@pytest.mark.parametrize("seed", range(12))
def test_rloo_matches_reference(seed):
    b = random_batch(seed)
    out = get_adv_estimator("rloo")(AdvantageInputs(**b), AdvantageConfig(estimator="rloo"))
    lists = as_lists(b)
    assert_close(
        out.advantages,
        ref.rloo_reference(lists["scores"], lists["response_mask"], lists["group_index"]),
    )


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("baseline", [False, True])
@pytest.mark.parametrize("gamma, kl_coef", [(1.0, 0.0), (1.0, 0.05), (0.9, 0.1)])
def test_reinforce_pp_matches_reference(seed, baseline, gamma, kl_coef):
    b = random_batch(seed, holes=seed % 2 == 1)
    name = "reinforce_plus_plus_baseline" if baseline else "reinforce_plus_plus"
    out = get_adv_estimator(name)(
        AdvantageInputs(**b), AdvantageConfig(gamma=gamma, kl_coef=kl_coef)
    )
    lists = as_lists(b)
    adv, ret = ref.reinforce_pp_reference(
        lists["scores"],
        lists["response_mask"],
        lists["token_kl"],
        gamma,
        kl_coef,
        lists["group_index"] if baseline else None,
    )
    assert_close(out.advantages, adv, tol=1e-7)
    assert_close(out.returns, ret)


# ---------------------------------------------------------------- closed forms


def test_gae_lambda1_gamma1_is_reward_to_go_minus_value():
    b = random_batch(3)
    cfg = AdvantageConfig(lambda_policy=1.0, lambda_critic=1.0, whiten_advantages=False)
    out = get_adv_estimator("gae")(
        AdvantageInputs(b["scores"], b["response_mask"], b["values"]), cfg
    )
    mask = b["response_mask"].bool()
    # With one reward at the last token and gamma = 1, the reward-to-go is the score itself.
    expected = torch.where(mask, b["scores"][:, None] - b["values"], 0)
    assert torch.allclose(out.advantages, expected, atol=1e-12)
    # ... and the critic's lambda=1 target is the Monte-Carlo return: the score, every token.
    assert torch.allclose(out.returns, torch.where(mask, b["scores"][:, None], 0), atol=1e-12)


def test_gae_lambda0_is_td_error():
    b = random_batch(5)
    cfg = AdvantageConfig(lambda_policy=0.0, lambda_critic=0.0, gamma=0.97, whiten_advantages=False)
    out = get_adv_estimator("gae")(
        AdvantageInputs(b["scores"], b["response_mask"], b["values"]), cfg
    )
    mask = b["response_mask"].bool()
    for i in range(len(mask)):
        pos = mask[i].nonzero().flatten().tolist()
        for k, p in enumerate(pos):
            v_next = b["values"][i, pos[k + 1]] if k + 1 < len(pos) else 0.0
            r = b["scores"][i] if k + 1 == len(pos) else 0.0
            assert math.isclose(
                out.advantages[i, p], r + 0.97 * v_next - b["values"][i, p], abs_tol=1e-12
            )


def test_length_adaptive_lambda_formula_and_fallback():
    lengths = torch.tensor([0, 1, 10, 20, 21, 100, 1000, 10**6])
    lam = length_adaptive_lambda(lengths, alpha=0.05, fallback=0.9)
    # alpha * l <= 1 (l <= 20): no lambda in (0, 1) from the formula -> the fallback
    expected = [0.9, 0.9, 0.9, 0.9, 1 - 1 / 1.05, 0.8, 0.98, 1 - 1 / 5e4]
    assert lam.tolist() == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert (lam > 0).all() and (lam < 1).all()


def test_rloo_closed_form():
    b = random_batch(8)
    out = get_adv_estimator("rloo")(AdvantageInputs(**b), AdvantageConfig())
    for g in b["group_index"].unique():
        members = (b["group_index"] == g).nonzero().flatten()
        G = len(members)
        r = b["scores"][members]
        expected = G / (G - 1) * (r - r.mean())
        for i, e in zip(members.tolist(), expected.tolist(), strict=True):
            row = out.advantages[i][b["response_mask"][i].bool()]
            assert torch.allclose(row, torch.full_like(row, e), atol=1e-12)


def test_decoupled_lambdas_differ_and_critic_uses_lambda_critic():
    b = random_batch(4)
    inputs = AdvantageInputs(b["scores"], b["response_mask"], b["values"])
    decoupled = get_adv_estimator("gae")(
        inputs, AdvantageConfig(lambda_policy=0.5, lambda_critic=1.0)
    )
    shared = get_adv_estimator("gae")(inputs, AdvantageConfig(lambda_policy=0.5, lambda_critic=0.5))
    mc = get_adv_estimator("gae")(inputs, AdvantageConfig(lambda_policy=1.0, lambda_critic=1.0))
    assert torch.equal(decoupled.returns, mc.returns)  # returns come from lambda_critic only
    assert torch.equal(decoupled.advantages, shared.advantages)  # advantages from lambda_policy
    assert not torch.allclose(decoupled.returns, shared.returns)


# ---------------------------------------------------------------- whitening across ranks


def test_rewhiten_with_reduced_moments_equals_whole_batch():
    b = random_batch(6, max_len=20)
    cfg = AdvantageConfig(kl_coef=0.05)
    est = get_adv_estimator("reinforce_plus_plus")
    whole = est(AdvantageInputs(b["scores"], b["response_mask"], token_kl=b["token_kl"]), cfg)
    halves = [slice(0, len(b["scores"]) // 2), slice(len(b["scores"]) // 2, None)]
    parts = [
        est(AdvantageInputs(b["scores"][s], b["response_mask"][s], token_kl=b["token_kl"][s]), cfg)
        for s in halves
    ]
    reduced = Moments.from_tensor(sum(p.raw_moments().as_tensor() for p in parts))  # all-reduce
    rewhitened = torch.cat([p.rewhiten(reduced).advantages for p in parts])
    assert torch.allclose(rewhitened, whole.advantages, atol=1e-12)


# ---------------------------------------------------------------- KL


def test_kl_estimators():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=DTYPE)
    ref_logp = torch.tensor([[-1.5, -1.0, -0.5]], dtype=DTYPE)
    x = (logp - ref_logp)[0].tolist()
    assert kl_estimate(logp, ref_logp, "k1")[0].tolist() == pytest.approx(x)
    assert kl_estimate(logp, ref_logp, "k2")[0].tolist() == pytest.approx([0.5 * v * v for v in x])
    assert kl_estimate(logp, ref_logp, "k3")[0].tolist() == pytest.approx(
        [math.exp(-v) - 1 + v for v in x]
    )
    wild = kl_estimate(torch.tensor([[0.0]]), torch.tensor([[-1e4]]), "k3")
    assert torch.isfinite(wild).all()
    assert (kl_estimate(torch.randn(4, 6), torch.randn(4, 6), "k3") >= 0).all()
    with pytest.raises(ValueError, match="'k4' is not one of"):
        kl_estimate(logp, ref_logp, "k4")


def test_kl_in_reward_placement():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=DTYPE)
    kl = torch.full((2, 4), 0.5, dtype=DTYPE)
    r = kl_penalized_token_rewards(torch.tensor([1.0, -1.0], dtype=DTYPE), kl, mask, kl_coef=0.1)
    expected = torch.tensor([[-0.05, -0.05, 0.95, 0.0], [-1.05, 0.0, 0.0, 0.0]], dtype=DTYPE)
    assert torch.allclose(r, expected, atol=1e-12)


# ---------------------------------------------------------------- losses


def random_policy_batch(seed, B=7, T=9):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0], lengths[1] = 1, 0
    mask = (torch.arange(T)[None] < lengths[:, None]).to(DTYPE)
    old = -torch.rand(B, T, generator=g, dtype=DTYPE) * 3
    logp = old + 0.4 * torch.randn(B, T, generator=g, dtype=DTYPE)
    adv = torch.randn(B, T, generator=g, dtype=DTYPE)
    scores = torch.randn(B, generator=g, dtype=DTYPE)
    return logp, old, adv, mask, scores


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("dual_clip_c", [None, 3.0])
def test_policy_loss_matches_reference(seed, mode, dual_clip_c):
    logp, old, adv, mask, _ = random_policy_batch(seed)
    loss, metrics = ppo_policy_loss(
        logp, old, adv, mask, dual_clip_c=dual_clip_c, loss_agg_mode=mode
    )
    expected = ref.ppo_loss_reference(
        logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.28, dual_clip_c, mode
    )
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert 0 <= metrics["pg_clipfrac"] <= 1


def test_clip_fractions_name_the_side_that_binds():
    # token 0: ratio 1.5, A > 0 (above 1 + eps_high); token 1: ratio 0.5, A < 0 (below
    # 1 - eps_low); token 2: ratio 1.1, A > 0 (inside); token 3: ratio 1.5, A < 0 (no clip).
    ratio = torch.tensor([[1.5, 0.5, 1.1, 1.5]], dtype=DTYPE)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]], dtype=DTYPE)
    mask = torch.ones(1, 4, dtype=DTYPE)
    _, m = ppo_policy_loss(ratio.log(), torch.zeros_like(ratio), adv, mask)
    assert m["pg_clipfrac_high"].item() == 0.25 and m["pg_clipfrac_low"].item() == 0.25
    assert m["pg_clipfrac"].item() == 0.5


def test_clip_higher_is_asymmetric():
    mask = torch.ones(1, 2, dtype=DTYPE)
    old = torch.zeros(1, 2, dtype=DTYPE)
    adv = torch.ones(1, 2, dtype=DTYPE)
    # ratio 1.25 sits inside 1 + eps_high = 1.28 but outside symmetric 1.2.
    logp = torch.full((1, 2), math.log(1.25), dtype=DTYPE)
    higher, _ = ppo_policy_loss(logp, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.28)
    symmetric, _ = ppo_policy_loss(logp, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2)
    assert higher.item() == pytest.approx(-1.25) and symmetric.item() == pytest.approx(-1.2)


def split_rows(n, k):
    bounds = torch.linspace(0, n, k + 1).round().long().tolist()
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


@pytest.mark.parametrize("k", [1, 2, 3, 7])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_chunked_losses_with_global_counts_equal_whole_batch(k, mode):
    """Micro-batches (or DP ranks) summing their losses, each normalised by the global counts,
    reproduce the whole-batch loss and its gradient exactly."""
    logp, old, adv, mask, scores = random_policy_batch(11, B=14)
    values, returns = torch.randn_like(adv), torch.randn_like(adv)
    tokens, seqs = token_and_sequence_counts(mask)
    positive_tokens = (mask.bool() & (scores > 0)[:, None]).sum()

    def total_loss(lp, v, sl):
        pg, _ = ppo_policy_loss(
            lp[sl],
            old[sl],
            adv[sl],
            mask[sl],
            loss_agg_mode=mode,
            global_token_count=tokens,
            global_seq_count=seqs,
        )
        nll = positive_sample_nll_loss(lp[sl], mask[sl], scores[sl], positive_tokens)
        vf, _ = clipped_value_loss(
            v[sl],
            values.detach()[sl] * 0.9,
            returns[sl],
            mask[sl],
            loss_agg_mode=mode,
            global_token_count=tokens,
            global_seq_count=seqs,
        )
        return pg + 0.1 * nll + vf

    whole_lp, whole_v = logp.clone().requires_grad_(), values.clone().requires_grad_()
    whole = total_loss(whole_lp, whole_v, slice(None))
    whole.backward()
    chunk_lp, chunk_v = logp.clone().requires_grad_(), values.clone().requires_grad_()
    chunked = sum(total_loss(chunk_lp, chunk_v, sl) for sl in split_rows(len(mask), k))
    chunked.backward()
    assert chunked.item() == pytest.approx(whole.item(), abs=1e-12)
    assert torch.allclose(chunk_lp.grad, whole_lp.grad, atol=1e-14)
    assert torch.allclose(chunk_v.grad, whole_v.grad, atol=1e-14)


def test_local_counts_differ_from_global_when_split():
    """The bug the global counts prevent: per-micro-batch normalisation changes the loss."""
    logp, old, adv, mask, _ = random_policy_batch(2, B=14)
    whole, _ = ppo_policy_loss(logp, old, adv, mask)
    halves = split_rows(len(mask), 2)
    naive = sum(ppo_policy_loss(logp[s], old[s], adv[s], mask[s])[0] for s in halves) / 2
    assert abs(naive.item() - whole.item()) > 1e-6


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("dual_clip_c", [None, 3.0])
def test_policy_loss_gradcheck(mode, dual_clip_c):
    logp, old, adv, mask, _ = random_policy_batch(4, B=4, T=5)
    logp = logp.clone().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda lp: ppo_policy_loss(lp, old, adv, mask, dual_clip_c=dual_clip_c, loss_agg_mode=mode)[
            0
        ],
        (logp,),
    )


def test_nll_and_value_loss_gradcheck():
    logp, _, _, mask, scores = random_policy_batch(5, B=4, T=5)
    assert torch.autograd.gradcheck(
        lambda lp: positive_sample_nll_loss(lp, mask, scores), (logp.clone().requires_grad_(),)
    )
    values = torch.randn(4, 5, dtype=DTYPE, requires_grad=True)
    old, ret = torch.randn(4, 5, dtype=DTYPE), torch.randn(4, 5, dtype=DTYPE)
    assert torch.autograd.gradcheck(
        lambda v: clipped_value_loss(v, old, ret, mask, clip_eps=0.3)[0], (values,)
    )


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("counts", ["global", "local"])
def test_losses_on_a_device_read_nothing_back_to_the_host(mode, counts):
    """On an accelerator the host queues a micro-batch's losses and their backward without
    waiting for the device: no value is read back (a branch on a tensor, `item`, `nonzero`,
    a count copied from the host). On the meta device every such read raises."""
    meta = torch.device("meta")

    def leaf():
        return torch.empty(3, 5, device=meta, requires_grad=True)

    mask, scores = torch.empty(3, 5, device=meta), torch.empty(3, device=meta)
    tokens, seqs, positive = (
        torch.empty(3, dtype=torch.float64, device=meta) if counts == "global" else [None] * 3
    )
    logprobs, values = leaf(), leaf()
    pg, metrics = ppo_policy_loss(
        logprobs,
        torch.empty(3, 5, device=meta),
        torch.empty(3, 5, device=meta),
        mask,
        dual_clip_c=3.0,
        loss_agg_mode=mode,
        global_token_count=tokens,
        global_seq_count=seqs,
    )
    vf, vf_metrics = clipped_value_loss(
        values, torch.empty(3, 5, device=meta), torch.empty(3, 5, device=meta), mask,
        loss_agg_mode=mode, global_token_count=tokens, global_seq_count=seqs,
    )  # fmt: skip
    kl = kl_estimate(logprobs, torch.empty(3, 5, device=meta), "k3")
    loss = (
        pg
        + positive_sample_nll_loss(logprobs, mask, scores, positive)
        + aggregate_loss(kl, mask, mode, tokens, seqs)
        + vf
    )
    loss.backward()
    assert logprobs.grad.device == values.grad.device == meta
    assert all(m.device == meta for m in [*metrics.values(), *vf_metrics.values()])


def test_positive_nll_uses_scores_and_is_zero_without_positives():
    logp, _, _, mask, _ = random_policy_batch(7)
    scores = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0, -1.0, -1.0], dtype=DTYPE)
    nll = positive_sample_nll_loss(logp, mask, scores)
    pos = mask.bool() & (scores > 0)[:, None]
    assert nll.item() == pytest.approx(-logp[pos].sum().item() / pos.sum().item())
    none = positive_sample_nll_loss(logp.requires_grad_(), mask, -scores.abs())
    assert none.item() == 0.0 and not torch.isnan(none)
    none.backward()  # still part of the graph
    assert torch.equal(logp.grad, torch.zeros_like(logp))


def test_value_loss_clipping():
    mask = torch.ones(1, 2, dtype=DTYPE)
    old = torch.zeros(1, 2, dtype=DTYPE)
    values = torch.tensor([[1.0, 0.1]], dtype=DTYPE)
    returns = torch.tensor([[2.0, 0.0]], dtype=DTYPE)
    loss, m = clipped_value_loss(values, old, returns, mask, clip_eps=0.2)
    # token 0: max((1-2)^2, (0.2-2)^2) = 3.24; token 1: max(0.01, 0.01) = 0.01
    assert loss.item() == pytest.approx(0.5 * (3.24 + 0.01) / 2)
    assert m["vf_clipfrac"].item() == pytest.approx(0.5)


def test_value_clip_fraction_counts_only_tokens_the_clip_moved():
    """Values within eps of the old ones are not clipped, whatever the rounding: V_old +
    (V - V_old) is not V bit for bit, and comparing losses built from it counted ~1 in 10
    such tokens as clipped (a metric that changed with the micro-batch split)."""
    g = torch.Generator().manual_seed(0)
    values = torch.randn(64, 32, generator=g)  # float32, as the critic's values
    returns = torch.randn(64, 32, generator=g)
    mask = torch.ones(64, 32)
    near = values + 0.3 * torch.rand(64, 32, generator=g) - 0.15  # all within eps = 0.2
    noisy = (near + (values - near).clamp(-0.2, 0.2) - returns).square() > (
        values - returns
    ).square()
    assert noisy.any()  # the old formula's rounding noise, on this data
    _, m = clipped_value_loss(values, near, returns, mask, clip_eps=0.2)
    assert m["vf_clipfrac"].item() == 0.0
    far = values + torch.where(torch.rand(64, 32, generator=g) < 0.5, 0.5, -0.5)
    _, m = clipped_value_loss(values, far, returns, mask, clip_eps=0.2)
    moved = torch.clamp(values, far - 0.2, far + 0.2)  # every token moved by the clip
    expected = ((moved - returns).square() > (values - returns).square()).double().mean()
    assert m["vf_clipfrac"].item() == pytest.approx(expected.item()) and 0.2 < expected < 0.8


def test_entropy_and_explained_variance():
    logits = torch.randn(3, 4, 11, dtype=DTYPE)
    expected = torch.distributions.Categorical(logits=logits).entropy()
    assert torch.allclose(entropy_from_logits(logits), expected, atol=1e-12)
    assert entropy_from_logits(torch.zeros(1, 8)).item() == pytest.approx(math.log(8), abs=1e-6)
    mask = torch.ones(2, 5, dtype=DTYPE)
    returns = torch.randn(2, 5, dtype=DTYPE)
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    mean_pred = torch.full_like(returns, returns.mean().item())
    assert explained_variance(mean_pred, returns, mask).item() == pytest.approx(0.0, abs=1e-12)
    assert math.isnan(explained_variance(returns, torch.ones_like(returns), mask).item())


def test_explained_variance_of_a_split_batch_is_the_whole_batchs():
    g = torch.Generator().manual_seed(0)
    returns = torch.randn(6, 5, generator=g, dtype=DTYPE)
    returns[:3] = 1.0  # one part (a micro-batch, a DP rank) with constant returns
    values = returns + 0.5 * torch.randn(6, 5, generator=g, dtype=DTYPE)
    mask = (torch.rand(6, 5, generator=g) < 0.8).to(DTYPE)
    parts = [slice(0, 3), slice(3, 6)]
    moments = [
        (Moments.of(returns[p], mask[p]), Moments.of(returns[p] - values[p], mask[p]))
        for p in parts
    ]
    added = [Moments.from_tensor(sum(m[i].as_tensor() for m in moments)) for i in (0, 1)]
    whole = explained_variance(values, returns, mask)
    assert explained_variance_of(*added).item() == pytest.approx(whole.item(), rel=1e-12)
    # the per-part statistic is undefined on the constant part, so a NaN-skipping mean of
    # parts reports the other part alone: not the batch's explained variance
    per_part = [explained_variance(values[p], returns[p], mask[p]).item() for p in parts]
    assert math.isnan(per_part[0]) and per_part[1] != pytest.approx(whole.item(), abs=0.05)


def test_gae_reports_the_lambda_each_sequence_used():
    b = random_batch(4)
    inputs = AdvantageInputs(b["scores"], b["response_mask"], b["values"])
    adaptive = get_adv_estimator("gae")(inputs, AdvantageConfig(length_adaptive_alpha=0.2))
    lengths = b["response_mask"].sum(dim=1)
    expected = length_adaptive_lambda(lengths, 0.2, AdvantageConfig().lambda_policy)
    assert torch.equal(adaptive.lambda_policy, expected)
    fixed = get_adv_estimator("gae")(inputs, AdvantageConfig(lambda_policy=0.9))
    assert fixed.lambda_policy.tolist() == [0.9] * len(b["scores"])


def test_aggregate_empty_batch_is_zero():
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        out = aggregate_loss(torch.randn(3, 4), torch.zeros(3, 4), mode)
        assert out.item() == 0.0


def test_masked_whiten_zero_on_padding():
    x, mask = torch.randn(4, 6, dtype=DTYPE), (torch.rand(4, 6) > 0.3).to(DTYPE)
    w = masked_whiten(x, mask)
    assert (w[mask == 0] == 0).all()
    valid = w[mask.bool()]
    assert valid.mean().item() == pytest.approx(0.0, abs=1e-12)
    assert valid.std().item() == pytest.approx(1.0, abs=1e-6)


# ---------------------------------------------------------------- bad input


def test_bad_inputs_are_clear_errors():
    b = random_batch(1)
    est, cfg = get_adv_estimator("gae"), AdvantageConfig()
    with pytest.raises(
        ValueError, match=r"values has shape \(.*\), expected .* like response_mask"
    ):
        est(AdvantageInputs(b["scores"], b["response_mask"], b["values"][:-1]), cfg)
    half = torch.full_like(b["response_mask"], 0.5)
    with pytest.raises(ValueError, match="response_mask must contain only 0 and 1, found 0.5"):
        est(AdvantageInputs(b["scores"], half, b["values"]), cfg)
    nan_scores = b["scores"].clone()
    nan_scores[2] = float("nan")
    with pytest.raises(ValueError, match=r"scores has a non-finite value nan at index \[2\]"):
        est(AdvantageInputs(nan_scores, b["response_mask"], b["values"]), cfg)
    with pytest.raises(ValueError, match="gae needs values"):
        est(AdvantageInputs(b["scores"], b["response_mask"]), cfg)
    single = torch.arange(len(b["scores"]))
    for name in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
        with pytest.raises(
            ValueError, match=rf"{name} needs G >= 2 samples per prompt; group sizes found: \[1\]"
        ):
            get_adv_estimator(name)(
                AdvantageInputs(b["scores"], b["response_mask"], group_index=single), cfg
            )
        with pytest.raises(ValueError, match=f"{name} needs group_index"):
            get_adv_estimator(name)(AdvantageInputs(b["scores"], b["response_mask"]), cfg)
    with pytest.raises(ValueError, match=r"scores must be \[B\] with B="):
        est(AdvantageInputs(b["scores"][:-1], b["response_mask"], b["values"]), cfg)
    with pytest.raises(
        ValueError, match=r"unknown advantage estimator 'gpro' \(did you mean 'grpo'\?\)"
    ):
        get_adv_estimator("gpro")
    with pytest.raises(ValueError, match="lambda_policy must be in"):
        AdvantageConfig(lambda_policy=1.5)
    logp, old, adv, mask, _ = random_policy_batch(0)
    with pytest.raises(
        ValueError, match=r"advantages has shape \(7, 8\), expected \(7, 9\) like logprobs"
    ):
        ppo_policy_loss(logp, old, adv[:, :-1], mask)
    with pytest.raises(ValueError, match="loss_agg_mode 'mean' is not one of"):
        ppo_policy_loss(logp, old, adv, mask, loss_agg_mode="mean")
    with pytest.raises(ValueError, match="dual_clip_c must be > 1"):
        ppo_policy_loss(logp, old, adv, mask, dual_clip_c=0.5)


def test_policy_losses_are_a_registry_keyed_by_name():
    """`vanilla` is ppo_policy_loss with the config's settings; a new loss is one function and
    one decorator, and the config accepts its name; an unknown name is refused with a hint."""
    from dataclasses import replace

    from megatron_rl.algorithms import (
        POLICY_LOSSES,
        get_policy_loss_fn,
        ppo_policy_loss,
        register_policy_loss,
    )
    from megatron_rl.workers.losses_config import PolicyLossConfig

    logp, old, adv, mask, _ = random_policy_batch(0)
    cfg = PolicyLossConfig(clip_eps_low=0.1, clip_eps_high=0.3, dual_clip_c=3.0)
    loss, metrics = get_policy_loss_fn("vanilla")(logp, old, adv, mask, cfg, 40.0, 7.0)
    expected, expected_metrics = ppo_policy_loss(
        logp, old, adv, mask, clip_eps_low=0.1, clip_eps_high=0.3, dual_clip_c=3.0,
        global_token_count=40.0, global_seq_count=7.0,
    )  # fmt: skip
    assert torch.equal(loss, expected) and metrics.keys() == expected_metrics.keys()

    @register_policy_loss("test_reinforce")
    def reinforce(logp, old, adv, mask, config, tokens=None, seqs=None):
        return aggregate_loss(-adv * logp, mask, config.loss_agg_mode, tokens, seqs), {}

    try:
        assert replace(cfg, loss_mode="test_reinforce").loss_mode == "test_reinforce"
        got, _ = get_policy_loss_fn("test_reinforce")(logp, old, adv, mask, cfg)
        assert torch.equal(got, aggregate_loss(-adv * logp, mask))
        with pytest.raises(ValueError, match="'test_reinforce' is already registered"):
            register_policy_loss("test_reinforce")(reinforce)
    finally:
        del POLICY_LOSSES["test_reinforce"]
    with pytest.raises(ValueError, match=r"loss_mode\) 'vanila' \(did you mean 'vanilla'\?\)"):
        PolicyLossConfig(loss_mode="vanila")
