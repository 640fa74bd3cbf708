"""Unit tier: the benchmarks' own arithmetic (their runs: test_bench_distributed.py)."""

import pytest


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
    apart = [{**r, "rollout/staleness": float(i % 2), "rollout/mixed_version_share": 0.25 * i,
              "rollout/interleaved": float(i > 1)}
             for i, r in enumerate(rows)]  # fmt: skip
    got = summary(apart)
    assert got["staleness"] == round(2 / 3, 3) and got["mixed_version_share"] == 0.5
    assert got["interleaved"] == round(2 / 3, 3)


def test_time_to_bar_sums_the_steps_up_to_the_first_evaluation_at_the_bar():
    from tools.bench_async import to_bar

    rows = [
        {"step": 1, "stage": "value_pretrain"},  # synchronous in every mode: left out
        {"step": 0, "stage": "eval", "eval/accuracy": 0.4},
        {"step": 1, "stage": "train", "timing/step_s": 2.0},
        {"step": 2, "stage": "train", "timing/step_s": 3.0, "eval/accuracy": 0.6},
        {"step": 3, "stage": "train", "timing/step_s": 2.0},
        {"step": 4, "stage": "train", "timing/step_s": 4.0, "eval/accuracy": 0.65},
        {"step": 5, "stage": "train", "timing/step_s": 2.0},
        {"step": 6, "stage": "train", "timing/step_s": 4.0, "eval/accuracy": 0.62},
    ]
    got = to_bar(rows, min_gain=0.25)
    assert got == {"accuracy_before": 0.4, "accuracy_end": 0.62, "steps_to_bar": 4,
                   "time_to_bar_s": 11.0}  # fmt: skip
    never = to_bar(rows, min_gain=0.3)
    assert never["steps_to_bar"] is None and never["time_to_bar_s"] is None


def test_a_profiled_step_reports_its_wall_time_and_prints_its_costliest_operators(capsys):
    import torch

    from tools.bench_train_step import profiled

    x = torch.randn(64, 64)
    out = profiled("matmuls", lambda: [x @ x for _ in range(3)])
    printed = capsys.readouterr().out
    assert "--- profile of matmuls: one step" in printed and "aten::mm" in printed
    assert out["profiled_s"] > 0
    # kernel time and host synchronisations exist on CUDA only: not invented on CPU
    assert set(out) == ({"profiled_s", "kernel_s", "kernel_share", "host_syncs"}
                        if torch.cuda.is_available() else {"profiled_s"})  # fmt: skip


def test_megatron_own_puts_megatron_functions_back_within_and_ours_after():
    import torch
    from megatron.core.tensor_parallel import layers
    from megatron.core.transformer import attention, mlp
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_rl.models.layer import use_lean_layer
    from megatron_rl.models.linear import use_plain_linear
    from megatron_rl.models.rotary import use_rotate_half_rope
    from megatron_rl.models.swiglu import swiglu, use_fused_swiglu
    from tools.bench_train_step import _megatron_glu, megatron_own, without_arms

    use_plain_linear(), use_rotate_half_rope(), use_fused_swiglu(), use_lean_layer()

    def looked_up():
        return (
            layers.linear_with_frozen_weight,
            attention.apply_rotary_pos_emb,
            mlp.bias_swiglu_impl,
            TransformerLayer.forward,
        )

    ours = looked_up()
    seen = []
    parts = ["linear", "rope", "swiglu", "layer"]
    arms = without_arms(parts, lambda: seen.append(looked_up()))
    assert list(arms) == [f"ppo_update_megatron_{p}" for p in parts]
    for step in arms.values():
        step()
    assert seen == [
        (ours[0].megatron_fn, ours[1], ours[2], ours[3]),
        (ours[0], ours[1].megatron_fn, ours[2], ours[3]),
        (ours[0], ours[1], _megatron_glu, ours[3]),  # megatron's unfused activation
        (ours[0], ours[1], ours[2], ours[3].megatron_fn),  # a method of a class
    ]
    assert looked_up() == ours
    x = torch.randn(3, 2, 8)
    torch.testing.assert_close(_megatron_glu(x, None), swiglu(x), rtol=0, atol=0)
    layers.linear_with_frozen_weight = ours[0].megatron_fn  # not routed: refused by name
    try:
        with pytest.raises(RuntimeError, match="linear_with_frozen_weight"):
            with megatron_own("linear"):
                pass
        assert layers.linear_with_frozen_weight is ours[0].megatron_fn  # nothing swapped
    finally:
        layers.linear_with_frozen_weight = ours[0]


@pytest.mark.parametrize("calculate_entropy", [True, False])
def test_the_softmax_form_of_a_tiles_sums_gives_the_same_log_sum_exp_and_entropy(
    calculate_entropy,
):
    """`softmax_sums` takes the tile's sums at its log-sum-exp (m = lse, s = 1, d = -H) where
    the head takes them at its max: the same log-sum-exp, entropy and label logits, from
    logits far apart (a near-one-hot row: entropy near 0, where a difference would cancel)."""
    import torch

    from megatron_rl.parallel import vocab
    from tools.bench_head import lse_and_entropy, softmax_sums

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(13, 40, generator=g) * 4
    logits[2, 7] = 60.0
    labels = torch.tensor([-40, -1, 7, 5, 39, 40, 79, 3, 3, 17, -7, 50, 1])
    got = torch.stack(softmax_sums(logits, labels, calculate_entropy=calculate_entropy))
    want = torch.stack(vocab._chunk_sums(logits.clone(), labels))
    assert (got[1] == 1).all()
    got, want = lse_and_entropy(got), lse_and_entropy(want)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[2], want[2], rtol=0, atol=0)
    if calculate_entropy:
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
        assert 0 < got[1, 2] < 1e-15
    else:
        assert (got[1] == 0).all()


def test_the_head_benchmark_times_every_arm_and_checks_the_compiled_sums(tmp_path):
    """One compiled arm (compiled on this CPU), checked equal to eager before it is timed."""
    import json

    from tools.bench_head import main

    out = tmp_path / "results.jsonl"
    args = ["--tokens", "24", "--rows", "96", "--hidden", "8", "--temperature", "0.8"]
    main([*args, "--compiled", "dynamic", "--steps", "2", "--warmup", "1", "--out", str(out)])
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["bench"] == "head" and (row["tokens"], row["rows"]) == (24, 96)
    for arm in ("gemm", "eager", "eager_logprobs", "eager_kept", "softmax", "softmax_logprobs"):
        assert row[f"{arm}_ms"] > 0
    assert row["compiled_dynamic_ms"] > 0 and row["compiled_kept_ms"] > 0
    assert row["speed_softmax_logprobs_over_eager_logprobs"] > 0
    assert row["speed_compiled_kept_over_eager_kept"] > 0
    assert "compiled_static_ms" not in row and "compiled_dynamic_error" not in row
    assert row["eager_sums_ms"] == pytest.approx(row["eager_ms"] - row["gemm_ms"], abs=1e-3)


def test_the_softmax_tile_sums_give_the_eager_heads_log_probs_entropy_and_gradients(
    monkeypatch,
):
    """The head with the sums of `softmax_sums` gives what the eager head gives, over blocks
    of rows and tokens (the blocks' sums merged in either form); the eager sums are back
    afterwards."""
    import torch

    from megatron_rl.parallel import vocab
    from tests.tolerances import FP32_MODEL, assert_close
    from tools import bench_head

    monkeypatch.setattr(vocab, "_tp", lambda: (0, 1, None))  # TP1 without a process group
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(30, 16, generator=g), torch.randn(128, 16, generator=g) * 0.5
    labels, coef = torch.randint(0, 100, (30,), generator=g), torch.randn(2, 30, generator=g)

    def run(keep_probs):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        lp, ent = vocab.chunked_logprobs_entropy(
            h, w, labels, 100, 0.8, tile=(16, 40), keep_probs=keep_probs
        )
        ((coef[0] * lp).sum() + (coef[1] * ent).sum()).backward()
        return lp.detach(), ent.detach(), h.grad, w.grad

    eager_sums = vocab._chunk_sums
    want = run(keep_probs=False)
    for keep_probs in (False, True):  # backward from recomputed logits or kept probabilities
        with bench_head.softmax_head_forward():
            assert vocab._chunk_sums is not eager_sums
            got = run(keep_probs)
        assert vocab._chunk_sums is eager_sums
        for name, a, b in zip(("logprobs", "entropy", "hidden", "weight"), got, want, strict=True):
            assert_close(a, b, FP32_MODEL, f"{name}, kept: {keep_probs}")


def test_the_train_step_names_compiled_functions_that_ran_eager(monkeypatch):
    """A row's `compiled_fell_back` (and each arm's `<arm>_compiled_fell_back`): the head's
    compiled functions that failed in that process and ran eager, which `tools.gpu_verdict`
    reads before it makes a choice between compiled and eager arms."""
    from megatron_rl.parallel import vocab_fused
    from tools import bench_train_step, gpu_verdict

    monkeypatch.setattr(vocab_fused, "FELL_BACK", [])
    assert bench_train_step.fell_back() == {}
    monkeypatch.setattr(vocab_fused, "FELL_BACK", ["tile_sums", "kept_probs_grad", "tile_sums"])
    row = {f"ppo_update_{k}": v for k, v in bench_train_step.fell_back().items()}
    assert row == {"ppo_update_compiled_fell_back": ["kept_probs_grad", "tile_sums"]}
    assert gpu_verdict.ran_eager({"parts": {"p": {"status": "passed", "results": [row]}}}, "p") == [
        "kept_probs_grad",
        "tile_sums",
    ]
