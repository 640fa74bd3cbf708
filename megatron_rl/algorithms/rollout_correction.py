"""Rollout correction: the samples come from the rollout engine's policy, not the trainer's.

vLLM and Megatron compute the same policy with different kernels, and often in another
precision (a bf16 or FP8 rollout, an fp32 trainer) or with truncated sampling (top-p /
top-k); the tokens are then drawn from pi_rollout while PPO's ratio is taken against the
trainer's recomputed pi_old. The importance weight of a token is

    w_t = pi_old(y_t) / pi_rollout(y_t) = exp(old_logprob_t - rollout_logprob_t)

- Truncated importance sampling (TIS; Yao et al. 2025, "Your efficient RL framework
  secretly brings you off-policy RL training"): the policy-gradient term of each token is
  multiplied by min(w_t, C) ("token"), or every token of a sequence by min(prod_t w_t, C)
  ("sequence"). The weights are constants (no gradient).
- Rejection sampling ("rs"): tokens ("token") or whole sequences ("sequence": prod_t w_t,
  "geometric": its per-token geometric mean) whose ratio leaves [lower, upper] are dropped
  from the update (their response-mask entries become 0). A sequence holding a token whose
  w_t is below `rollout_token_veto_threshold` is dropped whole (a catastrophic mismatch).

Asynchronous rollouts (`async.max_staleness` 1: `rollout/service/protocol.py`) make the same
weights cover staleness too: pi_rollout is then the behaviour policy that sampled the tokens,
up to k updates older, and pi_old, the trainer's forward at the current weights, is the
*proximal* policy of decoupled PPO (Hilton et al. 2021, "Batch size-invariance for policy
optimization", arXiv 2110.00641; AReaL, Fu et al. 2025, arXiv 2505.24298): PPO's clip on
pi_theta / pi_old times the weight pi_old / pi_behaviour is its objective, with `rollout_is:
token` as AReaL's clamped behaviour weight and `rollout_rs: token` as its mask. No extra
knob: the weights are the same, and since w >= 0 scales both arms of the clipped surrogate,
"w times A" is "w times the per-token loss" (tested in
tests/algorithms/test_rollout_correction_unit.py).

`bypass_mode` (verl's) goes the other way: pi_old *is* pi_rollout (the engine's log-probs,
no trainer forward), the cheap proximal policy of AReaL and verl's fully async recipe.

Names as verl's `algorithm.rollout_correction` (rollout_is, rollout_is_threshold, rollout_rs,
rollout_rs_threshold, rollout_rs_threshold_lower, rollout_token_veto_threshold). The
diagnostics (`rollout_corr/*`) are computed every step, correction on or off, from sums a
caller can all-reduce over data-parallel ranks (`CorrectionSums`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from megatron_rl.algorithms.masked import masked_sum

RolloutIS = Literal["token", "sequence"]
RolloutRS = Literal["token", "sequence", "geometric"]
LOG_RATIO_BOUND = 20.0
"""A token's log w, and a sequence's sum of them (log prod_t w_t), is clamped to [-20, 20]
before exp (verl's safety bound: fp32 cannot overflow); a sequence's tokens are summed
unclamped, so its weight is min(prod_t w_t, C) as written, whatever single tokens reach."""


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    rollout_is: RolloutIS | None = None
    """Importance weights on the policy-gradient term: per token, per sequence, or off."""
    rollout_is_threshold: float = 2.0
    """C: weights are truncated at C (TIS; verl's default 2.0)."""
    rollout_rs: RolloutRS | None = None
    """Rejection of tokens / sequences whose ratio leaves [lower, upper]; None: off."""
    rollout_rs_threshold: float | None = None
    """upper (> 1); required with rollout_rs."""
    rollout_rs_threshold_lower: float | None = None
    """lower (< 1); None: 1 / upper."""
    rollout_token_veto_threshold: float | None = None
    """Drop a whole sequence when one of its tokens has w_t below this (e.g. 1e-4)."""
    bypass_mode: bool = False
    """Take the engine's log-probs as pi_old and skip the actor's forward pass that computes
    them (verl's name; AReaL's and verl fully_async's cheap proximal policy): PPO's ratio is
    then pi_theta / pi_behaviour, clipped, with no decoupling, and one actor forward per step
    is saved. Nothing is then measured of the engine-trainer gap (`rollout_corr/*`,
    `rollout/logprob_gap/*` are not logged) and nothing can correct it, so the weights and
    rejections above are refused with it."""

    def __post_init__(self) -> None:
        if self.bypass_mode and (self.rollout_is is not None or self.rejects):
            raise ValueError(
                "bypass_mode takes the engine's log-probs as pi_old, so pi_old / pi_rollout "
                "is 1: rollout_is, rollout_rs and rollout_token_veto_threshold would do "
                "nothing; leave them null with bypass_mode, or turn bypass_mode off"
            )
        if self.rollout_is is not None and self.rollout_is not in ("token", "sequence"):
            raise ValueError(f"rollout_is must be token, sequence or null, got {self.rollout_is!r}")
        if self.rollout_rs is not None and self.rollout_rs not in (
            "token",
            "sequence",
            "geometric",
        ):
            raise ValueError(
                f"rollout_rs must be token, sequence, geometric or null, got {self.rollout_rs!r}"
            )
        if not self.rollout_is_threshold > 0:
            raise ValueError(f"rollout_is_threshold must be > 0, got {self.rollout_is_threshold}")
        if self.rollout_rs is not None:
            if self.rollout_rs_threshold is None or not self.rollout_rs_threshold > 1:
                raise ValueError(
                    f"rollout_rs={self.rollout_rs} needs rollout_rs_threshold > 1, got "
                    f"{self.rollout_rs_threshold}"
                )
            if not 0 < self.rs_band[0] < 1:
                raise ValueError(
                    f"rollout_rs_threshold_lower must be in (0, 1), got {self.rs_band[0]}"
                )
        veto = self.rollout_token_veto_threshold
        if veto is not None and not 0 < veto < 1:
            raise ValueError(f"rollout_token_veto_threshold must be in (0, 1), got {veto}")

    @property
    def rs_band(self) -> tuple[float, float]:
        upper = self.rollout_rs_threshold
        lower = self.rollout_rs_threshold_lower
        return (1.0 / upper if lower is None else lower), upper

    @property
    def rejects(self) -> bool:
        """Whether tokens or sequences can be dropped from the update."""
        return self.rollout_rs is not None or self.rollout_token_veto_threshold is not None


@dataclass(frozen=True)
class RolloutCorrection:
    weights: torch.Tensor | None
    """[B, S] truncated importance weights (1 off the response), None without rollout_is."""
    keep: torch.Tensor
    """[B, S] response mask after rejection (the input mask when nothing is rejected)."""
    sums: torch.Tensor
    """[len(CorrectionSums.FIELDS)] float64 sums for the diagnostics (all-reduce with SUM)."""
    maxima: torch.Tensor
    """[len(CorrectionSums.MAX_FIELDS)] float64 maxima (all-reduce with MAX)."""


class CorrectionSums:
    """The diagnostics from sums and maxima reduced over data-parallel ranks, so they are
    statistics of the DP-global batch: `CorrectionSums.metrics(sums, maxima)`."""

    FIELDS = (
        "tokens", "sequences", "w", "w_sq", "w_clipped", "log_ratio", "k3",
        "tokens_rejected", "sequences_rejected", "abs_gap",
    )  # fmt: skip
    MAX_FIELDS = ("w_max", "abs_gap_max")

    @classmethod
    def metrics(cls, sums: torch.Tensor, maxima: torch.Tensor) -> dict[str, float]:
        s = dict(zip(cls.FIELDS, sums.tolist(), strict=True))
        m = dict(zip(cls.MAX_FIELDS, maxima.tolist(), strict=True))
        n = max(s["tokens"], 1.0)
        return {
            # E[w] is 1 when the engines agree; its spread is the mismatch's size.
            "rollout_corr/rollout_is_mean": s["w"] / n,
            "rollout_corr/rollout_is_max": m["w_max"],
            "rollout_corr/rollout_is_eff_sample_size": s["w"] ** 2 / max(n * s["w_sq"], 1e-30),
            "rollout_corr/rollout_is_clipped_fraction": s["w_clipped"] / n,
            "rollout_corr/rollout_rs_masked_fraction": s["tokens_rejected"] / n,
            "rollout_corr/rollout_rs_seq_masked_fraction": s["sequences_rejected"]
            / max(s["sequences"], 1.0),
            # KL(pi_rollout || pi_old) estimated on the rollout's own samples: k1 and k3.
            "rollout_corr/kl": -s["log_ratio"] / n,
            "rollout_corr/k3_kl": s["k3"] / n,
            # |old - rollout| log-prob: 1e-6 when the engines agree (fp32, same kernels).
            "rollout/logprob_gap/mean": s["abs_gap"] / n,
            "rollout/logprob_gap/max": m["abs_gap_max"],
        }


def compute_rollout_correction(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    config: RolloutCorrectionConfig,
) -> RolloutCorrection:
    """Weights, kept mask and diagnostics of one batch.

    old_logprobs: [B, S] the trainer's log-probs of the sampled tokens (pi_old);
    rollout_logprobs: [B, S] the engine's, of the distribution it sampled from;
    response_mask: [B, S] 0/1.
    """
    valid = response_mask.bool()
    unbounded = torch.where(valid, old_logprobs.double() - rollout_logprobs.double(), 0.0)
    log_ratio = unbounded.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    w_token = torch.exp(log_ratio)
    # log prod_t w_t, bounded once summed (verl): per-token bounds would change the product
    seq_log_ratio = unbounded.sum(dim=1)
    lengths = response_mask.double().sum(dim=1)
    has_tokens = lengths > 0

    keep_seq = torch.ones_like(has_tokens)
    keep_token = valid.clone()
    if config.rollout_rs is not None:
        lower, upper = config.rs_band
        if config.rollout_rs == "token":
            keep_token &= (w_token >= lower) & (w_token <= upper)
        else:
            per_seq = seq_log_ratio
            if config.rollout_rs == "geometric":
                per_seq = seq_log_ratio / lengths.clamp(min=1)
            ratio = torch.exp(per_seq.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
            keep_seq &= (ratio >= lower) & (ratio <= upper)
    if config.rollout_token_veto_threshold is not None:
        vetoed = (valid & (w_token < config.rollout_token_veto_threshold)).any(dim=1)
        keep_seq &= ~vetoed
    keep_token &= keep_seq[:, None]
    keep = keep_token.to(response_mask.dtype)

    c = config.rollout_is_threshold
    weights = None
    if config.rollout_is == "token":
        raw = w_token
    else:
        raw = torch.exp(seq_log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))[:, None]
        raw = raw.expand_as(w_token)
    if config.rollout_is is not None:
        weights = torch.where(valid, raw.clamp(max=c), 1.0).to(old_logprobs.dtype)

    gap = (old_logprobs.double() - rollout_logprobs.double()).abs()
    sums = torch.stack(
        [
            response_mask.double().sum(),
            has_tokens.double().sum(),
            masked_sum(w_token, valid),
            masked_sum(w_token * w_token, valid),
            masked_sum((raw > c).double(), valid),
            masked_sum(log_ratio, valid),
            masked_sum(w_token - 1 - log_ratio, valid),
            (valid & ~keep_token).double().sum(),
            (has_tokens & ~keep_seq).double().sum(),
            masked_sum(gap, valid),
        ]
    )
    maxima = torch.stack(
        [
            w_token[valid].max() if valid.any() else gap.new_zeros((), dtype=torch.float64),
            gap[valid].max() if valid.any() else gap.new_zeros((), dtype=torch.float64),
        ]
    )
    return RolloutCorrection(weights, keep, sums, maxima)


GAP_TURNS = 8
"""Turns with a log-prob gap metric of their own; later turns are pooled into the last."""


def turn_gap_sums(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    turn_index: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """|old - rollout| log-prob per policy turn of multi-turn rollouts, as sums to all-reduce
    (fixed shapes, so every data-parallel rank takes part whatever turns it holds).

    old_logprobs, rollout_logprobs: [B, S]; response_mask: [B, S] 0/1 (policy tokens);
    turn_index: [B, S] long, the turn of each token (-1 off the response), turns >= GAP_TURNS
    pooled into the last. Returns (sums [GAP_TURNS, 2] float64: tokens and summed gaps,
    SUM-reduce; maxima [GAP_TURNS] float64: the largest gap, MAX-reduce).
    """
    valid = response_mask.bool() & (turn_index >= 0)
    turn = turn_index.clamp(0, GAP_TURNS - 1)[valid]
    gap = (old_logprobs.double() - rollout_logprobs.double()).abs()[valid]
    sums = gap.new_zeros(GAP_TURNS, 2)
    sums[:, 0].index_add_(0, turn, torch.ones_like(gap))
    sums[:, 1].index_add_(0, turn, gap)
    maxima = gap.new_zeros(GAP_TURNS).scatter_reduce_(0, turn, gap, "amax")
    return sums, maxima


def turn_gap_metrics(sums: torch.Tensor, maxima: torch.Tensor) -> dict[str, float]:
    """`rollout/logprob_gap/turn_{k}/{mean,max}` of the turns that have tokens (the last, k =
    GAP_TURNS - 1, pools every later turn), from reduced `turn_gap_sums`."""
    out = {}
    for k, ((tokens, total), top) in enumerate(zip(sums.tolist(), maxima.tolist(), strict=True)):
        if tokens > 0:
            out[f"rollout/logprob_gap/turn_{k}/mean"] = total / tokens
            out[f"rollout/logprob_gap/turn_{k}/max"] = top
    return out


def pack_diagnostics(
    rc: RolloutCorrection, turn_sums: torch.Tensor, turn_maxima: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's and the turns' diagnostics as one tensor of sums and one of maxima: one
    all-reduce each (SUM, MAX) over data-parallel ranks, then `diagnostics_metrics`."""
    return torch.cat([rc.sums, turn_sums.flatten()]), torch.cat([rc.maxima, turn_maxima])


def diagnostics_metrics(sums: torch.Tensor, maxima: torch.Tensor) -> dict[str, float]:
    """Metrics of reduced `pack_diagnostics`: `CorrectionSums.metrics`, and the per-turn gap
    when some sample of the (global) batch had a second turn."""
    n, m = len(CorrectionSums.FIELDS), len(CorrectionSums.MAX_FIELDS)
    metrics = CorrectionSums.metrics(sums[:n], maxima[:m])
    turns = sums[n:].view(GAP_TURNS, 2)
    if turns[1:, 0].sum() > 0:
        metrics.update(turn_gap_metrics(turns, maxima[m:]))
    return metrics
