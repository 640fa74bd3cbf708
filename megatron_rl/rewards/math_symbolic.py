"""The `math` reward's default backend: answers judged equal by symbolic equivalence, with
Hugging Face's math-verify (github.com/huggingface/Math-Verify; used by open-r1, TRL, verl).

The final answer is extracted by the same rules as the fast backend (`math_answers.py`: last
`\\boxed{}`, "answer is", "####", optionally the last number); prediction and label are
then parsed as LaTeX (or plain expressions) into sympy and compared: numbers, fractions,
radicals, pi, powers, percent, units, degrees, intervals, tuples, sets, matrices,
expressions up to algebra (`(x+1)^2` = `x^2+2x+1`), multiple-choice letters (`\\text{(B)}`
= `B`). The fast rules go first: a pair they find equal is not parsed (integers, the common
case), and a pair with a side math-verify cannot parse keeps their verdict.

Timeouts: math-verify's own (SIGALRM) are off, because they work only in a process's main
thread; the bound is the reward's `timeout_s`, enforced by the killable worker process every
`math` reward runs in (`rewards/isolated.py`).
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import Any

from megatron_rl.rewards.math_answers import answers_match

# math-verify warns on every call that its own timeouts are off: that is on purpose here.
logging.getLogger("math_verify").setLevel(logging.ERROR)


@lru_cache(maxsize=4096)
def _parsed(text: str) -> tuple:
    """math-verify's parse of `text` as inline LaTeX (with plain-expression fallback); () when
    nothing parses. Cached: labels repeat over a group's samples."""
    # why: math-verify loads sympy (seconds): only the symbolic backend needs it
    from math_verify import parse

    return tuple(parse(f"${text}$", parsing_timeout=None))


def symbolic_match(prediction: str, label: Any, rel_tol: float = 1e-6) -> bool:
    """`prediction` (an extracted final answer) equals `label`, exactly (fast rules) or
    symbolically (math-verify, rounding floats to 6 decimals as it does)."""
    if answers_match(prediction, label, rel_tol):
        return True
    # why: math-verify loads sympy (seconds): only the symbolic backend needs it
    from math_verify import verify

    gold, pred = _parsed(str(label)), _parsed(prediction)
    if not gold or not pred:
        return False
    return bool(verify(list(gold), list(pred), timeout_seconds=None))


def warm_up() -> None:
    """Import math-verify, sympy and the LaTeX grammar and judge one pair, so the first scored
    sample does not pay seconds of cold imports against its time limit; a missing package
    fails here, when the scorer is built."""
    if not symbolic_match(r"\sqrt{4}", "2"):
        raise RuntimeError("math-verify judged sqrt(4) != 2: a broken installation")
