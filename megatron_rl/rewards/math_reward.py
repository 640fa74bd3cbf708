"""Rule reward for math: extract the final answer of a response, compare it with the label.

The answer is the last `\\boxed{...}` (or `\\fbox{...}`), else the text after "answer is" /
"Answer:" / GSM8K's "####", else (optionally) the last number in the response. Two backends
judge it against the label:

- `math_verify` (the default): symbolic equivalence with Hugging Face's math-verify
  (`math_symbolic.py`): expressions, radicals, pi, powers, intervals, tuples, matrices,
  choice letters.
- `fast`: the rules below, no sympy. Prediction and label are normalised (LaTeX spacing and
  sizing commands, `\\text{}` units, degree and percent signs, thousands separators,
  `\\dfrac`, `x = ...`) and compared as exact rationals or floats (relative tolerance) when
  both parse as numbers, else as normalised strings. Right for integer and plain-number
  answers (AIME, DAPO-Math-17k); it judges `\\frac{\\pi}{2}` vs `\\pi/2`, `(x+1)^2` vs
  `x^2+2x+1`, `\\sqrt{18}` vs `3\\sqrt{2}` or `10^{3}` vs `1000` wrong, a false negative
  the policy learns from (docs/data-and-rewards.md, "Math answers").

VC-PPO / VAPO (arXiv 2503.01491, 2504.05118) train on +1 for a correct answer and -1
otherwise; both values, and the value for a response with no answer at all, are configurable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_rl.rewards.math_answers import answers_match, extract_answer
from megatron_rl.rewards.math_symbolic import symbolic_match

BACKENDS = ("math_verify", "fast")


@dataclass(frozen=True)
class MathVerifierConfig:
    correct_reward: float = 1.0
    incorrect_reward: float = -1.0
    unparseable_reward: float = -1.0
    """No final answer could be extracted from the response."""
    fallback_last_number: bool = True
    """Without a boxed / "answer is" answer, take the response's last number."""
    rel_tol: float = 1e-6
    """`fast`: for numbers that are not both exact rationals (0.333333 vs 1/3 never match;
    math-verify rounds both to 6 decimals, so there they do)."""
    backend: str = "math_verify"
    """"math_verify" (symbolic, the default) or "fast" (numbers and strings only)."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"math reward backend {self.backend!r}: expected one of {BACKENDS}")


@dataclass(frozen=True)
class Verdict:
    status: str
    """"correct", "incorrect" or "unparseable"."""
    extracted: str | None


def verify(response: str, label: Any, config: MathVerifierConfig | None = None) -> Verdict:
    config = config or MathVerifierConfig()
    if label is None:
        raise ValueError("math verifier: the sample has no label (set data label_key)")
    answer = extract_answer(response, config.fallback_last_number)
    if answer is None:
        return Verdict("unparseable", None)
    if config.backend == "math_verify":
        ok = symbolic_match(answer, label, config.rel_tol)
    else:
        ok = answers_match(answer, label, config.rel_tol)
    return Verdict("correct" if ok else "incorrect", answer)


def math_reward(response: str, label: Any, config: MathVerifierConfig | None = None) -> float:
    config = config or MathVerifierConfig()
    status = verify(response, label, config).status
    return {
        "correct": config.correct_reward,
        "incorrect": config.incorrect_reward,
        "unparseable": config.unparseable_reward,
    }[status]
