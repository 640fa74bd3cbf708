"""Write the tool-use sums (the tool-use demo's task): `tool_sums_train.jsonl` (540 rows) and
`tool_sums_test.jsonl` (100 held-out rows) beside this file.

    python examples/tiny/data/make_tool_sums.py [OUT_DIR] [--tool-share 0.4]

"What is 48213 + 90577?": two 5-digit addends, too long a sum for the tiny model to do in
its head, while copying digits is easy for it. Rows carry `prompt`, `answer` (the label the
reward checks) and `solution`, the worked response the supervised warm start imitates: for a
fraction `--tool-share` of the rows a call of the code interpreter, its answer, and the
boxed result (`code` tool format, `rollout/tool_formats.py`):

    <tool_call>print(48213 + 90577)</tool_call><tool_response>138790</tool_response>The answer is \\boxed{138790}.

and for the others a direct answer, "The answer is \\boxed{138790}." (right: the warm start
learns the format, RL must find that the tool is what makes it right). The pairs are split
at random (seed 0); none is in both files.
"""

import argparse
import json
import random
from pathlib import Path

TRAIN, TEST = 540, 100


def solution(a: int, b: int, with_tool: bool) -> str:
    answer = f"The answer is \\boxed{{{a + b}}}."
    if not with_tool:
        return answer
    return f"<tool_call>print({a} + {b})</tool_call><tool_response>{a + b}</tool_response>{answer}"


def rows(pairs, rng: random.Random, tool_share: float) -> list[dict]:
    return [
        {
            "prompt": f"What is {a} + {b}?",
            "answer": str(a + b),
            "solution": solution(a, b, rng.random() < tool_share),
        }
        for a, b in pairs
    ]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", nargs="?", default=str(Path(__file__).parent))
    p.add_argument("--tool-share", type=float, default=0.4)
    a = p.parse_args(argv)
    rng = random.Random(0)
    pairs = set()
    while len(pairs) < TRAIN + TEST:
        pairs.add((rng.randint(10000, 99999), rng.randint(10000, 99999)))
    pairs = sorted(pairs)
    rng.shuffle(pairs)
    out = Path(a.out_dir)
    for name, part in (("train", pairs[:TRAIN]), ("test", pairs[TRAIN:])):
        path = out / f"tool_sums_{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows(part, rng, a.tool_share)))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
