"""The maths of megatron_rl as pure tensor functions (no torch.distributed, Megatron, vLLM).

Advantages (`advantages`), KL (`kl`), losses (`losses`), masked statistics (`masked`).
Cross-rank reductions happen in the caller, which passes global counts and moments in.
"""

from megatron_rl.algorithms.advantages import (
    ADV_ESTIMATOR_TRAITS,
    ADV_ESTIMATORS,
    AdvantageConfig,
    AdvantageInputs,
    AdvantageOutputs,
    estimator_traits,
    gae,
    get_adv_estimator,
    length_adaptive_lambda,
    register_adv_est,
)
from megatron_rl.algorithms.kl import kl_estimate, kl_penalized_token_rewards, outcome_token_rewards
from megatron_rl.algorithms.losses import (
    POLICY_LOSSES,
    aggregate_loss,
    clipped_value_loss,
    entropy_from_logits,
    explained_variance,
    explained_variance_of,
    get_policy_loss_fn,
    positive_sample_nll_loss,
    ppo_policy_loss,
    register_policy_loss,
    token_and_sequence_counts,
    token_mean,
)
from megatron_rl.algorithms.masked import (
    Moments,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

__all__ = [
    "ADV_ESTIMATOR_TRAITS",
    "ADV_ESTIMATORS",
    "AdvantageConfig",
    "AdvantageInputs",
    "AdvantageOutputs",
    "Moments",
    "aggregate_loss",
    "clipped_value_loss",
    "entropy_from_logits",
    "explained_variance",
    "explained_variance_of",
    "estimator_traits",
    "gae",
    "get_adv_estimator",
    "kl_estimate",
    "kl_penalized_token_rewards",
    "length_adaptive_lambda",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "outcome_token_rewards",
    "positive_sample_nll_loss",
    "ppo_policy_loss",
    "POLICY_LOSSES",
    "get_policy_loss_fn",
    "register_policy_loss",
    "token_mean",
    "register_adv_est",
    "token_and_sequence_counts",
]
