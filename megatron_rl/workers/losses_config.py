"""Typed settings of the actor's and critic's losses (VAPO defaults where the paper gives one)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.algorithms.kl import KLEstimator
from megatron_rl.algorithms.losses import LOSS_AGGREGATIONS, LossAggregation, get_policy_loss_fn


@dataclass(frozen=True)
class PolicyLossConfig:
    loss_mode: str = "vanilla"
    """A registered policy loss (`algorithms.losses.POLICY_LOSSES`, verl's names)."""
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    """Clip-higher (DAPO/VAPO); set equal to clip_eps_low for symmetric PPO."""
    dual_clip_c: float | None = None
    loss_agg_mode: LossAggregation = "token-mean"
    nll_coef: float = 0.0
    """mu of VAPO's positive-sample NLL term (0.1 in the paper); 0 turns it off."""
    entropy_coef: float = 0.0
    """Entropy bonus; entropy is logged whatever this is."""
    kl_loss_coef: float = 0.0
    """beta of a KL term in the loss (GRPO); needs ref_logprobs in the batch."""
    kl_estimator: KLEstimator = "k3"

    def __post_init__(self) -> None:
        get_policy_loss_fn(self.loss_mode)  # refuses an unknown name, naming the known ones
        if self.loss_agg_mode not in LOSS_AGGREGATIONS:
            raise ValueError(
                f"loss_agg_mode {self.loss_agg_mode!r} is not one of {LOSS_AGGREGATIONS}"
            )
        for name in ("nll_coef", "entropy_coef", "kl_loss_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class ValueLossConfig:
    clip_eps: float | None = 0.5
    loss_agg_mode: LossAggregation = "token-mean"
