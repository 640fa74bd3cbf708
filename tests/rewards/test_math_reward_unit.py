"""The math reward against tables of answer formats, for both backends (VC-PPO / VAPO rule
reward): `math_verify` (symbolic, the default) and `fast` (numbers and strings).

CASES: extraction rules (boxed, "answer is", "####", the last number) and the formats both
backends judge alike, with one known difference. EQUIVALENCES: the MATH-style formats of
the issue that asked for symbolic checking, by category; every right answer is correct
under `math_verify`, every wrong one incorrect under both.
"""

from __future__ import annotations

import pytest

from megatron_rl.rewards.math_answers import extract_answer, parse_number
from megatron_rl.rewards.math_reward import MathVerifierConfig, math_reward, verify

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


# (response, label): status under math_verify where it differs from CASES' (fast) one
SYMBOLIC_DIFFERS = {
    # math-verify compares floats rounded to 6 decimals (as graders of MATH-style evals do)
    (r"\boxed{\frac{1}{3}}", "0.333333"): "correct",
}

# (response, label, category, whether `fast` judges it correct)
EQUIVALENCES = [
    # the eight misses of the fast rules: expressions, pi, choices, powers, radicals
    (r"\boxed{x^2+2x+1}", "(x+1)^2", "expressions", False),
    (r"\boxed{\pi/2}", r"\frac{\pi}{2}", "pi", False),
    (r"\boxed{\text{(B)}}", "B", "choices", False),
    (r"\boxed{10^{3}}", "1000", "powers", False),
    (r"\boxed{3\sqrt{2}}", r"\sqrt{18}", "radicals", False),
    (r"\boxed{a+b}", "b+a", "expressions", False),
    (r"\boxed{\sqrt{2}/2}", r"\frac{\sqrt{2}}{2}", "radicals", False),
    (r"\boxed{2}", r"\sqrt{4}", "radicals", False),
    # numbers
    (r"\boxed{007}", "7", "numbers", True),
    (r"\boxed{-0}", "0", "numbers", True),
    (r"\boxed{1.000}", "1", "numbers", True),
    (r"\boxed{2.5}", "2.50", "numbers", True),
    (r"\boxed{1e-3}", "0.001", "numbers", True),
    (r"\boxed{3.14}", r"\pi", "close but wrong", False),
    (r"\boxed{0.3}", r"\frac{1}{3}", "close but wrong", False),
    (r"\boxed{1001}", "1000", "close but wrong", False),
    (r"\boxed{-12}", "12", "close but wrong", False),
    # fractions
    (r"\boxed{\frac{6}{8}}", r"\frac{3}{4}", "fractions", True),
    (r"\boxed{1\frac{1}{2}}", r"\frac{3}{2}", "fractions", False),
    (r"\boxed{\frac{3}{2}}", "1.5", "fractions", True),
    (r"\boxed{\frac{2}{3}}", r"\frac{3}{2}", "close but wrong", False),
    (r"\boxed{\frac{a}{b}}", "a/b", "fractions", False),
    # radicals
    (r"\boxed{2\sqrt{3}}", r"\sqrt{12}", "radicals", False),
    (r"\boxed{\sqrt{8}}", r"2\sqrt{2}", "radicals", False),
    (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{\sqrt{2}}{2}", "radicals", False),
    (r"\boxed{\sqrt[3]{27}}", "3", "radicals", False),
    (r"\boxed{\sqrt{3}}", r"\sqrt{2}", "close but wrong", False),
    (r"\boxed{2+\sqrt{3}}", r"\sqrt{3}+2", "radicals", False),
    # pi
    (r"\boxed{2\pi}", r"\pi \cdot 2", "pi", False),
    (r"\boxed{\frac{3\pi}{4}}", r"\frac{3}{4}\pi", "pi", False),
    (r"\boxed{\pi r^2}", r"r^2\pi", "pi", False),
    (r"\boxed{4\pi}", r"2\pi", "close but wrong", False),
    # powers
    (r"\boxed{2^{10}}", "1024", "powers", False),
    (r"\boxed{x^{2}}", "x^2", "powers", False),
    (r"\boxed{3^4}", "81", "powers", False),
    (r"\boxed{2^{-1}}", "0.5", "powers", False),
    (r"\boxed{2^9}", "1024", "close but wrong", False),
    # units, percent, currency, degrees
    (r"\boxed{5 \text{ meters}}", "5", "units", True),
    (r"\boxed{12\,\mathrm{cm}}", "12", "units", True),
    (r"\boxed{25\%}", "25", "percent", True),
    (r"\boxed{\$1,200}", "1200", "currency", True),
    (r"\boxed{\$3.50}", "3.5", "currency", True),
    (r"\boxed{45^{\circ}}", "45", "degrees", True),
    (r"\boxed{45^\circ}", "46", "close but wrong", False),
    # choices
    (r"\boxed{C}", r"\text{C}", "choices", True),
    (r"\boxed{(D)}", "D", "choices", False),
    (r"\boxed{\textbf{(E)}}", "E", "choices", False),
    (r"\boxed{A}", "B", "close but wrong", False),
    # intervals
    (r"\boxed{[1, 2)}", "[1,2)", "intervals", True),
    (r"\boxed{(-\infty, 3]}", r"(-\infty,3]", "intervals", True),
    (r"\boxed{[0,1]}", "[0,1)", "close but wrong", False),
    (r"\boxed{(0, \infty)}", r"(0,\infty)", "intervals", True),
    # tuples and sets
    (r"\boxed{(1, 2)}", "(1,2)", "tuples", True),
    (r"\boxed{(1,2)}", "(2,1)", "close but wrong", False),
    (r"\boxed{\{1, 2, 3\}}", r"\{3, 2, 1\}", "sets", False),
    (r"\boxed{1, 2}", "2, 1", "sets", False),
    # matrices
    (
        r"\boxed{\begin{pmatrix} 1 \\ 2 \end{pmatrix}}",
        r"\begin{pmatrix}1\\2\end{pmatrix}",
        "matrices",
        False,
    ),
    (
        r"\boxed{\begin{pmatrix} 1 & 0 \\ 0 & 1 \end{pmatrix}}",
        r"\begin{pmatrix}1&0\\0&1\end{pmatrix}",
        "matrices",
        False,
    ),
    (
        r"\boxed{\begin{pmatrix} 1 \\ 3 \end{pmatrix}}",
        r"\begin{pmatrix}1\\2\end{pmatrix}",
        "close but wrong",
        False,
    ),
    # expressions and equations
    (r"\boxed{2x+2}", "2(x+1)", "expressions", False),
    (r"\boxed{\frac{x}{2}}", r"0.5x", "expressions", False),
    (r"\boxed{y = 2x + 1}", "2x+1", "expressions", True),
    (r"\boxed{x^2-1}", "(x-1)(x+1)", "expressions", False),
    (r"\boxed{x^2+1}", "(x+1)^2", "close but wrong", False),
    (r"\boxed{\log_2 8}", "3", "expressions", False),
    (r"\boxed{\frac{\pi}{3}}", r"\frac{\pi}{2}", "close but wrong", False),
    (r"\boxed{x^2}", "x^3", "close but wrong", False),
    (r"\boxed{\$12}", "13", "close but wrong", False),
    (r"\boxed{-\frac{1}{2}}", r"\frac{1}{2}", "close but wrong", False),
]
WRONG = "close but wrong"
FAST = MathVerifierConfig(backend="fast")


@pytest.mark.parametrize("response,label,status", CASES)
def test_extraction_and_formats_fast(response, label, status):
    assert verify(response, label, FAST).status == status


@pytest.mark.parametrize("response,label,status", CASES)
def test_extraction_and_formats_math_verify(response, label, status):
    status = SYMBOLIC_DIFFERS.get((response, label), status)
    assert verify(response, label).status == status


@pytest.mark.parametrize("response,label,category,fast_ok", EQUIVALENCES)
def test_equivalences_math_verify_judges_every_one_right(response, label, category, fast_ok):
    expected = "incorrect" if category == WRONG else "correct"
    assert verify(response, label).status == expected


@pytest.mark.parametrize("response,label,category,fast_ok", EQUIVALENCES)
def test_equivalences_fast_misses_the_symbolic_ones(response, label, category, fast_ok):
    assert verify(response, label, FAST).status == ("correct" if fast_ok else "incorrect")


def test_tables_are_large_and_cover_the_categories():
    assert len(CASES) + len(EQUIVALENCES) >= 100
    categories = {c for _, _, c, _ in EQUIVALENCES}
    assert {"numbers", "fractions", "radicals", "pi", "powers", "units", "percent", "currency",
            "degrees", "choices", "intervals", "tuples", "sets", "matrices", "expressions",
            WRONG} <= categories  # fmt: skip
    assert sum(c == WRONG for _, _, c, _ in EQUIVALENCES) >= 15


def test_an_unknown_backend_is_refused_by_name():
    from megatron_rl.rewards.config import MathRewardConfig

    with pytest.raises(ValueError, match="math reward backend 'sympy': expected one of"):
        MathRewardConfig(backend="sympy")


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


def test_symbolic_equivalence_credits_an_unevaluated_expression_and_fast_does_not():
    """Why the arithmetic recipes use `fast`: the question's own sum, boxed, equals its
    answer symbolically."""
    assert verify(r"\boxed{3 + 4}", "7").status == "correct"
    assert verify(r"\boxed{3 + 4}", "7", FAST).status == "incorrect"
