"""The math verifier against a table of answer formats (VC-PPO / VAPO rule reward)."""

from __future__ import annotations

import pytest

from megatron_rl.rewards.math_verify import (
    MathVerifierConfig,
    extract_answer,
    math_reward,
    parse_number,
    verify,
)

# (response, label, expected status)
CASES = [
    # boxed, plain integers and signs
    (r"so the answer is \boxed{42}", "42", "correct"),
    (r"\boxed{42}", 42, "correct"),
    (r"\boxed{-7}", "-7", "correct"),
    (r"\boxed{-7}", "7", "incorrect"),
    (r"\boxed{ 13 }", "13", "correct"),
    (r"\boxed 5", "5", "correct"),
    (r"\fbox{9}", "9", "correct"),
    (r"first \boxed{1}, then corrected: \boxed{2}", "2", "correct"),
    (r"first \boxed{1}, then corrected: \boxed{2}", "1", "incorrect"),
    # fractions and decimals
    (r"\boxed{\frac{1}{2}}", "0.5", "correct"),
    (r"\boxed{\dfrac{3}{4}}", r"\frac34", "correct"),
    (r"\boxed{\tfrac{2}{4}}", "1/2", "correct"),
    (r"\boxed{-\frac{1}{3}}", r"\frac{-1}{3}", "correct"),
    (r"\boxed{\frac{1}{3}}", "0.333333", "incorrect"),
    (r"\boxed{0.50}", "1/2", "correct"),
    (r"\boxed{.5}", "0.5", "correct"),
    (r"\boxed{2/0}", "2", "incorrect"),
    (r"\boxed{1.5e3}", "1500", "correct"),
    (r"\boxed{3.0}", "3", "correct"),
    # nested braces and LaTeX
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{3}}{2}", "correct"),
    (r"\boxed{\sqrt2}", r"\sqrt{2}", "correct"),
    (r"\boxed{\left( 1, 2 \right)}", "(1,2)", "correct"),
    (r"\boxed{x = 5}", "5", "correct"),
    (r"\boxed{2\pi}", r"2\pi", "correct"),
    (r"\boxed{2\pi}", r"\pi", "incorrect"),
    (r"$\boxed{12}$.", "12", "correct"),
    # units, degrees, percent, money
    (r"\boxed{10\text{ cm}}", "10", "correct"),
    (r"\boxed{90^\circ}", "90", "correct"),
    (r"\boxed{50\%}", "50", "correct"),
    (r"\boxed{\$18}", "18", "correct"),
    (r"\boxed{\text{(A)}}", "(A)", "correct"),
    (r"\boxed{B}", "b", "correct"),
    # thousands separators
    (r"#### 1,000", "1000", "correct"),
    (r"\boxed{12,345,678}", "12345678", "correct"),
    # "answer is" / "Answer:" / GSM8K
    ("The answer is 42.", "42", "correct"),
    ("Final answer: 17", "17", "correct"),
    ("Answer: 12 apples", "12", "correct"),
    ("so the final answer is $-4$.", "-4", "correct"),
    ("#### 72", "72", "correct"),
    ("Answer: 12 apples", "13", "incorrect"),
    # trailing text and fallback to the last number
    ("We get 3, then 7 after simplifying.", "7", "correct"),
    ("We get 3, then 7 after simplifying.", "3", "incorrect"),
    ("It costs -2.5 dollars in total", "-5/2", "correct"),
    # no answer at all
    ("I do not know.", "1", "unparseable"),
    ("", "0", "unparseable"),
    (r"\boxed{", "1", "unparseable"),
]


@pytest.mark.parametrize("response,label,status", CASES)
def test_verifier_table(response, label, status):
    assert verify(response, label).status == status


def test_table_is_large():
    assert len(CASES) >= 40


def test_rewards_are_configurable():
    cfg = MathVerifierConfig(correct_reward=1.0, incorrect_reward=0.0, unparseable_reward=-0.5)
    assert math_reward(r"\boxed{4}", "4", cfg) == 1.0
    assert math_reward(r"\boxed{5}", "4", cfg) == 0.0
    assert math_reward("no idea", "4", cfg) == -0.5
    # VC-PPO's default: +1 / -1
    assert math_reward(r"\boxed{5}", "4") == -1.0


def test_without_number_fallback_only_explicit_answers_count():
    assert extract_answer("We get 7.", fallback_last_number=False) is None
    cfg = MathVerifierConfig(fallback_last_number=False)
    assert verify("We get 7.", "7", cfg).status == "unparseable"


def test_parse_number_is_exact_for_rationals():
    from fractions import Fraction

    assert parse_number(r"\frac{1}{3}") == Fraction(1, 3)
    assert parse_number("-0.25") == Fraction(-1, 4)
    assert parse_number("abc") is None


def test_missing_label_is_an_error():
    with pytest.raises(ValueError, match="no label"):
        verify(r"\boxed{1}", None)
