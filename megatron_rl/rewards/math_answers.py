"""Final answers of math responses: where the answer is (the last `\\boxed{...}` /
`\\fbox{...}`, else the text after "answer is" / "Answer:" / GSM8K's "####", else optionally
the last number), how it is normalised, and the `fast` backend's comparison (exact rationals,
floats within a relative tolerance, normalised strings). Shared by both backends of the
`math` reward (`math_reward.py`, `math_symbolic.py`); standard library only."""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any

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
