"""Write the worked-sum tasks: `sum_chains_train.jsonl` (540 rows) and `sum_chains_test.jsonl`
(100 held-out rows) beside this file, and with `--count-all 0.6` the demo's.

    python examples/tiny/data/make_sum_chains.py [OUT_DIR] [--count-all F | --swap-first F | --long-way F]

"What is 37 + 6?" is worked by moving one unit at a time from the right term to the left,
until the right one is 0, then the answer is boxed:

    37+6=38+5=39+4=40+3=41+2=42+1=43+0. The answer is \\boxed{43}.

a in [10, 89], b in [2, 9]: responses of 20-60 tokens (one token per digit), each step a
successor and a predecessor; one wrong step makes the boxed answer wrong. Rows carry `prompt`,
`answer` (the label the reward checks) and `solution` (the worked response the supervised
warm start imitates). The pairs are split at random (seed 0); none is in both files.

The demo's task (`make demo`, `--count-all 0.6`) decides the return at the first token:

- `--count-all F` writes `sum_chains_countall_{train,test}.jsonl`: a fraction F of the worked
  solutions count all from 1 (`1,2,3,...`), as a child does before learning to count on,
  cut off after COUNT_ALL_NUMBERS numbers (before the sum where it is smaller) with no
  answer: ~60 tokens that never earn the reward. The prompts are the default's; the warm
  start learns both ways, and RL must learn to count on.

Two more variants where the return is decided early (docs/experiments/demo.md, "How the demo's task was
chosen"):

- `--swap-first F` writes `sum_chains_swap_{train,test}.jsonl`: a fraction F of the prompts
  ask for the small term first ("What is 6 + 37?"), worked by swapping the terms first
  (`6+37=37+6=38+5=...`). A response that does not swap is doomed at its fourth token.
- `--long-way F` writes `sum_chains_longway_{train,test}.jsonl`: a fraction F of the worked
  solutions move units the other way, counting the large term down (`37+6=36+7=35+8=...`),
  cut off after LONG_WAY_STEPS steps with no answer (an 80-token response could finish the
  long way only for a <= 13). The prompts are the default's; the warm start learns both
  directions, and which one a response took shows from its first step on.
"""

import argparse
import json
import random
from pathlib import Path

LONG_WAY_STEPS = 12
"""Steps a long-way solution shows before it is cut off (~65 tokens)."""
COUNT_ALL_NUMBERS = 24
"""Numbers a count-all solution shows before it is cut off (62 tokens)."""


def chain(a: int, b: int) -> str:
    return "=".join(f"{a + i}+{b - i}" for i in range(b + 1))


def solution(x: int, y: int) -> str:
    """The worked response to "What is x + y?": the smaller term counts down."""
    steps = chain(x, y) if x >= y else f"{x}+{y}={chain(y, x)}"
    return f"{steps}. The answer is \\boxed{{{x + y}}}."


def long_way(a: int, b: int) -> str:
    """The first LONG_WAY_STEPS steps of counting the large term a down, and no answer; for
    a <= LONG_WAY_STEPS, the steps before it reaches 0 (the one that would finish)."""
    return "=".join(f"{a - i}+{b + i}" for i in range(min(LONG_WAY_STEPS, a)))


def count_all(a: int, b: int) -> str:
    """Counting from 1 up to COUNT_ALL_NUMBERS, or to a + b - 1 (the number before the
    answer) where that is smaller, and no answer."""
    return ",".join(str(i) for i in range(1, min(COUNT_ALL_NUMBERS, a + b - 1) + 1))


def main(
    out_dir: str | None = None,
    swap_first: float = 0.0,
    long_way_frac: float = 0.0,
    count_all_frac: float = 0.0,
) -> None:
    if sum(map(bool, (swap_first, long_way_frac, count_all_frac))) > 1:
        raise ValueError("--count-all, --swap-first, --long-way: expected one of them at most")
    pairs = [(a, b) for a in range(10, 90) for b in range(2, 10)]
    rng = random.Random(0)
    rng.shuffle(pairs)  # the default files draw nothing more from it
    here = Path(out_dir or Path(__file__).parent)
    here.mkdir(parents=True, exist_ok=True)
    variant = [("_swap", swap_first), ("_longway", long_way_frac), ("_countall", count_all_frac)]
    stem = "sum_chains" + "".join(suffix for suffix, frac in variant if frac)
    for name, rows in (("test", pairs[:100]), ("train", pairs[100:])):
        lines = []
        for a, b in rows:
            x, y = (b, a) if swap_first and rng.random() < swap_first else (a, b)
            if long_way_frac and rng.random() < long_way_frac:
                worked = long_way(a, b)
            elif count_all_frac and rng.random() < count_all_frac:
                worked = count_all(a, b)
            else:
                worked = solution(x, y)
            lines.append(json.dumps({"prompt": f"What is {x} + {y}?", "answer": str(x + y),
                                     "solution": worked}))  # fmt: skip
        tmp = here / f".{stem}_{name}.jsonl.tmp"
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(here / f"{stem}_{name}.jsonl")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", nargs="?")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--count-all", type=float, default=0.0, metavar="F")
    group.add_argument("--swap-first", type=float, default=0.0, metavar="F")
    group.add_argument("--long-way", type=float, default=0.0, metavar="F")
    a = p.parse_args()
    flags = (
        ("--count-all", a.count_all),
        ("--swap-first", a.swap_first),
        ("--long-way", a.long_way),
    )
    for flag, value in flags:
        if not 0 <= value <= 1:
            p.error(f"{flag} {value}: expected a fraction in [0, 1]")
    main(a.out_dir, a.swap_first, a.long_way, a.count_all)
