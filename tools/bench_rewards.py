"""Benchmark: what symbolic answer checking costs. The `math` reward's two backends
(`math_verify`, symbolic; `fast`, numbers and strings) score the same MATH-style responses,
inline and through the Ray reward pool, side by side in this process.

    python -m tools.bench rewards [--samples 2048 --workers 2]

The responses mix what a policy writes: integers (right and wrong), fractions, radicals,
pi, powers, expressions, intervals, matrices and choice letters, each with a right and a
close-but-wrong answer, every one with its own numbers so that no cache makes it free. Each
arm scores a warm-up batch first (worker start-up and imports are outside the timings). One
JSON line: samples/s per backend and pool, and the share of right answers each backend
finds right (the symbolic one should find them all).
"""

from __future__ import annotations

import argparse
import time

from megatron_rl.rewards import MathRewardConfig, ScoringPoolConfig, make_scoring_pool
from megatron_rl.rewards.base import RewardInput
from tools.bench_common import record

# (response, label, the response is right): {i} and {j} are filled per sample
FORMATS = [
    (r"so the answer is \boxed{{{i}}}", "{i}", True),
    (r"so the answer is \boxed{{{j}}}", "{i}", False),
    (r"\boxed{{\frac{{{i}}}{{{j}}}}}", "{i}/{j}", True),
    (r"\boxed{{{i}\sqrt{{2}}}}", r"\sqrt{{{two_i2}}}", True),
    (r"\boxed{{{i}\sqrt{{3}}}}", r"\sqrt{{{two_i2}}}", False),
    (r"\boxed{{\frac{{{i}\pi}}{{2}}}}", r"{i}\pi/2", True),
    (r"\boxed{{{i}^{{2}}}}", "{i2}", True),
    (r"\boxed{{x^2+{two_i}x+{i2}}}", "(x+{i})^2", True),
    (r"\boxed{{x^2+{i}x+{i2}}}", "(x+{i})^2", False),
    (r"\boxed{{[{i}, {j})}}", "[{i},{j})", True),
    (
        r"\boxed{{\begin{{pmatrix}} {i} \\ {j} \end{{pmatrix}}}}",
        r"\begin{{pmatrix}}{i}\\{j}\end{{pmatrix}}",
        True,
    ),
    (r"The answer is \text{{(B)}}.", "B", True),
]


def samples(n: int) -> tuple[list[RewardInput], list[bool]]:
    out, right = [], []
    for k in range(n):
        response, label, ok = FORMATS[k % len(FORMATS)]
        i = 2 + k // len(FORMATS)
        values = {"i": i, "j": i + 1, "i2": i * i, "two_i": 2 * i, "two_i2": 2 * i * i}
        out.append(RewardInput("", "", response.format(**values), label.format(**values)))
        right.append(ok)
    return out, right


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=256, help="samples per submitted batch")
    p.add_argument("--workers", type=int, default=2, help="Ray reward workers")
    p.add_argument("--out", default="bench/results.jsonl")
    a = p.parse_args(argv)

    batch, right = samples(a.samples)
    result = {"samples": a.samples, "batch_size": a.batch_size, "ray_workers": a.workers}
    for backend in ("fast", "math_verify"):
        fns = [MathRewardConfig(backend=backend, correct_reward=1.0, incorrect_reward=0.0)]
        for pool_name, workers in (("inline", 0), ("ray", a.workers)):
            pool = make_scoring_pool(fns, ScoringPoolConfig(num_workers=workers))
            pool.result(pool.submit(batch[: a.batch_size]))  # warm-up
            t0 = time.perf_counter()
            handles = [
                pool.submit(batch[s : s + a.batch_size]) for s in range(0, len(batch), a.batch_size)
            ]
            rewards = [r for h in handles for r in pool.result(h).scored.rewards]
            seconds = time.perf_counter() - t0
            pool.close()
            result[f"{backend}_{pool_name}_samples_per_s"] = round(len(batch) / seconds, 1)
        judged = [r > 0 for r in rewards]
        result[f"{backend}_right_found_right"] = round(
            sum(j for j, ok in zip(judged, right, strict=True) if ok) / sum(right), 3
        )
        result[f"{backend}_wrong_found_right"] = sum(
            j for j, ok in zip(judged, right, strict=True) if not ok
        )
    record("rewards", result, a.out)


if __name__ == "__main__":
    main()
