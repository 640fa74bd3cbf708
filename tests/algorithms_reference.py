"""Slow reference implementations in plain Python over lists, token by token.

Deliberately unlike the library: GAE as the explicit double sum sum_l (gamma*lam)^l delta_{t+l}
instead of the backward recursion, statistics with the `statistics` module, losses as loops.
Masks may have holes: a row's tokens are its valid positions, in order.
"""

from __future__ import annotations

import math
import statistics


def valid_positions(mask_row):
    return [t for t, m in enumerate(mask_row) if m]


def gae_row(rewards, values, mask_row, gamma, lam):
    pos = valid_positions(mask_row)
    n = len(pos)
    r = [rewards[p] for p in pos]
    v = [values[p] for p in pos] + [0.0]
    delta = [r[k] + gamma * v[k + 1] - v[k] for k in range(n)]
    out = [0.0] * len(mask_row)
    for k in range(n):
        out[pos[k]] = sum((gamma * lam) ** (j - k) * delta[j] for j in range(k, n))
    return out


def token_rewards_row(score, kl_row, mask_row, kl_coef):
    pos = valid_positions(mask_row)
    out = [0.0] * len(mask_row)
    for p in pos:
        out[p] = -kl_coef * kl_row[p]
    if pos:
        out[pos[-1]] += score
    return out


def whiten(rows, mask):
    flat = [
        x for row, m in zip(rows, mask, strict=True) for x, mm in zip(row, m, strict=True) if mm
    ]
    if not flat:
        return [[0.0] * len(r) for r in rows]
    mean = sum(flat) / len(flat)
    std = statistics.stdev(flat) if len(flat) > 1 else 0.0
    return [
        [(x - mean) / (std + 1e-8) if mm else 0.0 for x, mm in zip(row, m, strict=True)]
        for row, m in zip(rows, mask, strict=True)
    ]


def adaptive_lambda(length, alpha, fallback):
    if alpha * length <= 1:
        return fallback
    return 1.0 - 1.0 / (alpha * length)


def gae_reference(scores, values, mask, kl, cfg):
    rewards = [
        token_rewards_row(s, k, m, cfg.kl_coef) for s, k, m in zip(scores, kl, mask, strict=True)
    ]
    advantages, returns = [], []
    for r, v, m in zip(rewards, values, mask, strict=True):
        lam = cfg.lambda_policy
        if cfg.length_adaptive_alpha is not None:
            lam = adaptive_lambda(sum(m), cfg.length_adaptive_alpha, cfg.lambda_policy)
        advantages.append(gae_row(r, v, m, cfg.gamma, lam))
        critic = gae_row(r, v, m, cfg.gamma, cfg.lambda_critic)
        returns.append([c + vv if mm else 0.0 for c, vv, mm in zip(critic, v, m, strict=True)])
    if cfg.whiten_advantages:
        advantages = whiten(advantages, mask)
    return advantages, returns


def groups_of(group_index):
    groups = {}
    for i, g in enumerate(group_index):
        groups.setdefault(g, []).append(i)
    return groups


def broadcast(per_seq, mask):
    return [[a if m else 0.0 for m in row] for a, row in zip(per_seq, mask, strict=True)]


def grpo_reference(scores, mask, group_index, eps, norm_by_std=True):
    adv = [0.0] * len(scores)
    for members in groups_of(group_index).values():
        vals = [scores[i] for i in members]
        mean, std = statistics.mean(vals), statistics.stdev(vals)
        for i in members:
            adv[i] = (scores[i] - mean) / (std + eps) if norm_by_std else scores[i] - mean
    return broadcast(adv, mask)


def rloo_reference(scores, mask, group_index):
    adv = [0.0] * len(scores)
    for members in groups_of(group_index).values():
        for i in members:
            others = [scores[j] for j in members if j != i]
            adv[i] = scores[i] - sum(others) / len(others)
    return broadcast(adv, mask)


def reinforce_pp_reference(scores, mask, kl, gamma, kl_coef, group_index=None):
    if group_index is not None:
        means = {
            g: statistics.mean(scores[i] for i in ms) for g, ms in groups_of(group_index).items()
        }
        scores = [s - means[g] for s, g in zip(scores, group_index, strict=True)]
    returns = []
    for s, k, m in zip(scores, kl, mask, strict=True):
        r = token_rewards_row(s, k, m, kl_coef)
        pos = valid_positions(m)
        row = [0.0] * len(m)
        for a, p in enumerate(pos):
            row[p] = sum(gamma ** (b - a) * r[pos[b]] for b in range(a, len(pos)))
        returns.append(row)
    return whiten(returns, mask), returns


def ppo_loss_reference(logp, old, adv, mask, lo, hi, dual_c, mode):
    per_token = []
    for lr, lo_r, ar, mr in zip(logp, old, adv, mask, strict=True):
        row = []
        for a, b, A, m in zip(lr, lo_r, ar, mr, strict=True):
            ratio = math.exp(a - b)
            loss = max(-A * ratio, -A * min(max(ratio, 1 - lo), 1 + hi))
            if dual_c is not None and A < 0:
                loss = min(loss, -A * dual_c)
            row.append(loss if m else None)
        per_token.append(row)
    return aggregate_reference(per_token, mode)


def aggregate_reference(per_token, mode):
    """per_token: rows of floats, None marking padding."""
    rows = [[x for x in row if x is not None] for row in per_token]
    nonempty = [r for r in rows if r]
    if mode == "token-mean":
        n = sum(len(r) for r in rows)
        return sum(sum(r) for r in rows) / n if n else 0.0
    if not nonempty:
        return 0.0
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in nonempty) / len(nonempty)
    return sum(sum(r) for r in nonempty) / len(nonempty)
