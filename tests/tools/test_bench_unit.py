"""Unit tier: the benchmarks' own arithmetic (their runs: test_bench_distributed.py)."""


def test_async_summary_takes_medians_after_the_warm_up_and_bounds_the_overlap():
    from tools.bench_async import ideal_ratio_k1, summary

    rows = [
        {"timing/step_s": 9.0, "timing/rollout_s": 5.0, "timing/sync_s": 1.0,
         "rollout/response_length/mean": 10.0},  # warm-up: left out
        *({"timing/step_s": s, "timing/rollout_s": 2.0, "timing/sync_s": 0.5,
           "rollout/response_length/mean": 20.0} for s in (3.0, 4.0, 5.0)),
    ]  # fmt: skip
    got = summary(rows)
    assert got == {"step_s": 4.0, "rollout_wait_s": 2.0, "sync_s": 0.5, "response_length": 20.0}
    # a 4 s step of 2 s rollout and 2 s else: overlapped, 2 s at best
    assert ideal_ratio_k1(got) == 2.0
    assert ideal_ratio_k1({"step_s": 4.0, "rollout_wait_s": 1.0}) == round(4 / 3, 3)
    # apart runs log their staleness; partial rollouts the mixed-version share: means
    apart = [{**r, "rollout/staleness": float(i % 2), "rollout/mixed_version_share": 0.25 * i}
             for i, r in enumerate(rows)]  # fmt: skip
    got = summary(apart)
    assert got["staleness"] == round(2 / 3, 3) and got["mixed_version_share"] == 0.5
