"""Write the demo's worked-sum task: `sum_chains_train.jsonl` (540 rows) and
`sum_chains_test.jsonl` (100 held-out rows) beside this file.

    python examples/tiny/data/make_sum_chains.py [OUT_DIR]

"What is 37 + 6?" is worked by moving one unit at a time from the right term to the left,
until the right one is 0, then the answer is boxed:

    37+6=38+5=39+4=40+3=41+2=42+1=43+0. The answer is \\boxed{43}.

a in [10, 89], b in [2, 9]: responses of 20-60 tokens (one token per digit), each step a
successor and a predecessor; one wrong step makes the boxed answer wrong. Rows carry `prompt`,
`answer` (the label the reward checks) and `solution` (the worked response the supervised
warm start imitates). The pairs are split at random (seed 0); none is in both files.
"""

import json
import random
import sys
from pathlib import Path


def solution(a: int, b: int) -> str:
    steps = "=".join(f"{a + i}+{b - i}" for i in range(b + 1))
    return f"{steps}. The answer is \\boxed{{{a + b}}}."


def main(out_dir: str | None = None) -> None:
    pairs = [(a, b) for a in range(10, 90) for b in range(2, 10)]
    random.Random(0).shuffle(pairs)
    here = Path(out_dir or Path(__file__).parent)
    for name, rows in (("test", pairs[:100]), ("train", pairs[100:])):
        lines = [
            json.dumps({"prompt": f"What is {a} + {b}?", "answer": str(a + b),
                        "solution": solution(a, b)})
            for a, b in rows
        ]  # fmt: skip
        tmp = here / f".sum_chains_{name}.jsonl.tmp"
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(here / f"sum_chains_{name}.jsonl")


if __name__ == "__main__":
    main(*sys.argv[1:])
