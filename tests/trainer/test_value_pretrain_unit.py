"""Value pretraining's reporting (`megatron_rl/trainer/value_pretrain.py`): where it ended."""

from __future__ import annotations

import math

import pytest

from megatron_rl.trainer.value_pretrain import settled_explained_variance, unsettled_warning


def test_value_pretraining_ends_at_the_mean_ev_of_its_last_five_steps():
    # one demo run's ten steps: the last step alone (0.25) reads as a weak critic
    steps = [-0.08, 0.34, 0.15, 0.43, 0.30, 0.58, 0.37, 0.54, 0.13, 0.25]
    assert settled_explained_variance(steps) == pytest.approx(0.374)
    assert settled_explained_variance(steps[:2]) == pytest.approx(0.13)  # fewer steps ran
    assert math.isnan(settled_explained_variance([0.5, None, 0.5]))  # NaN is logged as null
    with pytest.raises(ValueError, match="no value-pretraining step"):
        settled_explained_variance([])


def test_a_critic_that_settled_below_the_floor_is_warned_about():
    warning = unsettled_warning([0.1, 0.2], 0.5)
    assert warning.startswith("warning: value pretraining ended at explained variance 0.15 ")
    assert "(mean of its last 2 steps) < 0.5 (critic.pretrain_ev_warn_below)" in warning
    assert unsettled_warning([0.1, None], 0.5) is not None  # NaN warns too
    assert unsettled_warning([0.6, 0.7], 0.5) is None
    assert unsettled_warning([], 0.5) is None  # resumed after it ended: nothing to read
