"""On-policy distillation's signal (`algorithms/distill.py`, the `on_policy_distill`
estimator) against a direct computation on hand-made log-probs."""

import pytest
import torch

from megatron_rl.algorithms.advantages import (
    AdvantageConfig,
    AdvantageInputs,
    estimator_traits,
    get_adv_estimator,
)
from megatron_rl.algorithms.distill import add_distillation, teacher_reverse_kl
from tests.tolerances import FP32_EXACT_ORDER, assert_close

# two responses: the second a multi-turn one whose tokens 1-2 are the environment's answer
STUDENT = torch.tensor([[-0.5, -1.0, -2.0, 0.0], [-0.1, -3.0, -0.7, -0.2]])
TEACHER = torch.tensor([[-0.2, -1.5, -0.3, 0.0], [-0.4, -0.1, -0.2, -2.2]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 1]])


def test_reverse_kl_is_student_minus_teacher_on_policy_tokens_only():
    kl = teacher_reverse_kl(STUDENT, TEACHER, MASK)
    by_hand = [[-0.5 + 0.2, -1.0 + 1.5, -2.0 + 0.3, 0.0], [-0.1 + 0.4, 0.0, 0.0, -0.2 + 2.2]]
    assert_close(kl, torch.tensor(by_hand), FP32_EXACT_ORDER)
    # environment tokens and padding: no signal, whatever the teacher thinks of them
    assert (kl[MASK == 0] == 0).all()


def test_the_signal_is_added_to_any_advantage_with_its_coefficient():
    advantages = torch.tensor([[1.0, 1.0, 1.0, 0.0], [-0.5, 0.0, 0.0, -0.5]])
    kl = teacher_reverse_kl(STUDENT, TEACHER, MASK)
    out = add_distillation(advantages, kl, kl_coef=0.5)
    expected = [
        [1.0 - 0.5 * -0.3, 1.0 - 0.5 * 0.5, 1.0 - 0.5 * -1.7, 0.0],
        [-0.5 - 0.5 * 0.3, 0.0, 0.0, -0.5 - 0.5 * 2.0],
    ]
    assert_close(out, torch.tensor(expected), FP32_EXACT_ORDER)
    # tokens the student samples more often than the teacher would are pushed down
    assert out[0, 2] > advantages[0, 2] and out[1, 3] < advantages[1, 3]


def test_the_distillation_estimator_gives_no_task_advantage_and_needs_no_critic():
    inputs = AdvantageInputs(scores=torch.tensor([1.0, 0.0]), response_mask=MASK)
    out = get_adv_estimator("on_policy_distill")(
        inputs, AdvantageConfig(estimator="on_policy_distill")
    )
    assert (out.advantages == 0).all() and (out.returns == 0).all() and not out.whitened
    traits = estimator_traits("on_policy_distill")
    assert traits.needs_teacher and not traits.needs_critic and not traits.needs_groups
    assert not any(estimator_traits(n).needs_teacher for n in ("gae", "grpo", "rloo"))


def test_log_probs_of_other_shapes_are_refused():
    with pytest.raises(ValueError, match=r"differ in shape"):
        teacher_reverse_kl(STUDENT, TEACHER[:, :3], MASK)
