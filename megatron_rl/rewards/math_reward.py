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

import math
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

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


_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+"


def _braced(text: str, start: int) -> tuple[str, int] | None:
    """Content of the brace group opening at text[start] == '{', and the index after it."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i], i + 1
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} / \\fbox{...} (or `\\boxed 5`), braces balanced."""
    last = None
    for m in re.finditer(r"\\(?:boxed|fbox)\s*", text):
        end = m.end()
        if end < len(text) and text[end] == "{":
            group = _braced(text, end)
            if group is not None:
                last = group[0]
        else:
            word = re.match(r"[^\s$]+", text[end:])
            if word:
                last = word.group(0)
    return last


def extract_answer(text: str, fallback_last_number: bool = True) -> str | None:
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    for pattern in (
        r"####\s*(.+)",
        r"(?i)final answer(?: is)?\s*[:：]?\s*(.+)",
        r"(?i)answer(?: is)?\s*[:：]\s*(.+)",
        r"(?i)answer is\s+(.+)",
    ):
        found = re.findall(pattern, text)
        if found:
            answer = found[-1].strip().split("\n")[0].strip()
            answer = re.sub(r"[.。]\s*$", "", answer).strip().strip("$").strip()
            if answer:
                return answer
    if fallback_last_number:
        numbers = re.findall(_NUMBER, text)
        if numbers:
            return numbers[-1]
    return None


def _strip_text_units(s: str) -> str:
    # "10\text{ cm}" -> "10", but "\text{(A)}" -> "(A)": keep text that is the whole answer.
    bare = re.sub(r"\\(?:text|mbox|mathrm)\{([^{}]*)\}", r"\1", s).strip()
    unitless = re.sub(r"\s*\\(?:text|mbox|mathrm)\{[^{}]*\}\s*$", "", s).strip()
    return unitless if unitless and re.fullmatch(rf"(?:{_NUMBER})", unitless) else bare


def normalize_answer(answer: str) -> str:
    s = str(answer).strip()
    boxed = last_boxed(s)
    if boxed is not None:
        s = boxed
    s = s.replace("\\!", "").replace("\\,", "").replace("\\;", "").replace("\\ ", " ")
    s = re.sub(r"\\(?:left|right|big|Big|bigg|Bigg)(?![a-zA-Z])", "", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("^\\circ", "").replace("^{\\circ}", "").replace("°", "")
    s = s.replace("\\%", "").replace("%", "").replace("\\$", "").replace("$", "")
    s = _strip_text_units(s)
    s = re.sub(r"^[a-zA-Z]\s*=\s*", "", s)  # "x = 5" -> "5"
    # "\frac12" -> "\frac{1}{2}", "\sqrt2" -> "\sqrt{2}"
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\d+)", r"\\sqrt{\1}", s)
    s = s.strip().rstrip(".").strip()
    # a number followed by a plain unit word: "5 cm", "12 apples"
    m = re.fullmatch(rf"({_NUMBER})\s+[a-zA-Z]+(?:\s+[a-zA-Z]+)*", s)
    if m:
        s = m.group(1)
    return re.sub(r"\s+", "", s)


def parse_number(s: str) -> Fraction | float | None:
    """Exact Fraction for integers, decimals and fractions (a/b, \\frac{a}{b}); float for
    scientific notation; None otherwise. Expects a normalised string."""
    neg = False
    if s.startswith("-"):
        neg, s = True, s[1:]
    m = re.fullmatch(r"\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", s) or re.fullmatch(
        r"(-?[\d.]+)/(-?[\d.]+)", s
    )
    try:
        if m:
            den = Fraction(m.group(2))
            if den == 0:
                return None
            value = Fraction(m.group(1)) / den
        elif re.fullmatch(r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+", s):
            value = Fraction(s.replace(",", ""))
        elif re.fullmatch(r"[\d.]+[eE][-+]?\d+", s):
            value = float(s)
            if not math.isfinite(value):
                return None
        else:
            return None
    except (ValueError, ZeroDivisionError):
        return None
    return -value if neg else value


def answers_match(prediction: str, label: Any, rel_tol: float = 1e-6) -> bool:
    pred, gold = normalize_answer(prediction), normalize_answer(str(label))
    a, b = parse_number(pred), parse_number(gold)
    if a is not None and b is not None:
        if isinstance(a, Fraction) and isinstance(b, Fraction):
            return a == b
        return math.isclose(float(a), float(b), rel_tol=rel_tol, abs_tol=1e-12)
    return pred.lower() == gold.lower() if pred.isalpha() and gold.isalpha() else pred == gold


def verify(response: str, label: Any, config: MathVerifierConfig | None = None) -> Verdict:
    config = config or MathVerifierConfig()
    if label is None:
        raise ValueError("math verifier: the sample has no label (set data label_key)")
    answer = extract_answer(response, config.fallback_last_number)
    if answer is None:
        return Verdict("unparseable", None)
    if config.backend == "math_verify":
        from megatron_rl.rewards.math_symbolic import symbolic_match

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
