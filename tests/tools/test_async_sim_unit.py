"""Unit tier: the async RL simulation (`tools/async_sim.py`): its pieces against arithmetic
done by hand, and the modes' relations that hold whatever the inputs."""

import pytest

from tools.async_sim import (
    Engine,
    Hardware,
    generation_s,
    main,
    simulate,
    simulate_partial,
    training_s,
)

HW = Hardware(hbm_efficiency=1.0)


def test_one_sequence_decodes_at_the_weights_roofline_plus_its_growing_kv():
    """1 GPU, 1e9 params (2 GB bf16), 1000 bytes of KV a token, a 100-token response after a
    10-token prompt: 100 steps each reading the weights and the context so far."""
    engine = Engine(params=10**9, kv_bytes_per_token=1000, tp=1)
    context = sum(10 + j for j in range(100))  # tokens of KV read at steps 0..99
    expected = (100 * 2e9 + 1000 * context) / HW.hbm_bytes_s
    prefill = 2e9 * 10 / (HW.peak_flops * HW.mfu)
    assert engine.time([100], 10, HW) == pytest.approx(expected + prefill, rel=1e-9)


def test_a_long_tail_costs_the_weights_per_step_whatever_the_batch():
    """With no KV cost, 64 sequences of 10 tokens and one of 1000 take 1000 steps: the tail."""
    engine = Engine(params=10**9, kv_bytes_per_token=0, tp=1)
    step = 2e9 / HW.hbm_bytes_s
    t = engine.time([10] * 64 + [1000], 0, HW)
    assert t == pytest.approx(1000 * step, rel=1e-9)


def test_more_gpus_never_generate_slower_and_training_scales_with_them():
    engine = Engine(params=10**9, kv_bytes_per_token=1000, tp=2)
    lengths = [50 + 37 * i % 900 for i in range(300)]
    times = [generation_s(lengths, g, engine, 20, HW) for g in (2, 4, 8, 16)]
    assert times == sorted(times, reverse=True)
    assert training_s(10**6, 10**9, 16, 8, HW) == pytest.approx(
        training_s(10**6, 10**9, 16, 16, HW) * 2
    )


def test_one_step_off_is_never_slower_than_synchronous_apart():
    engine = Engine(params=10**9, kv_bytes_per_token=1000, tp=2)
    lengths = [50 + 37 * i % 900 for i in range(300)]
    modes = simulate(lengths, 16, engine, trainer_unit=4, prompt_tokens=20, passes=16, hw=HW)
    assert modes["one_step_off"][0] <= modes["sync"][0]
    # every split leaves the trainers a multiple of TP x PP
    assert (16 - modes["sync"][1]) % 4 == 0 and (16 - modes["one_step_off"][1]) % 4 == 0


def test_partial_rollouts_pay_the_tail_once_per_stream_and_a_reprefill_per_push():
    """Two steps of 64 short responses and one of 1000 tokens on one engine (no KV cost):
    streamed, both steps' sequences run together, so the 1000-step tail is paid once for two
    steps; each push costs the push and a re-prefill of a full batch (256 sequences, of the
    mean context)."""
    engine = Engine(params=10**9, kv_bytes_per_token=0, tp=1)
    batch = [10] * 64 + [1000]
    step, s = simulate_partial([batch, batch], 2, engine, 1, 0, passes=1e-9, hw=HW)
    assert s == 1  # one GPU generates, one trains
    mean_context = sum(batch) / len(batch)
    reprefill = 2e9 * 256 * mean_context / (HW.peak_flops * HW.mfu)
    push = 2e9 / HW.push_bytes_s
    assert step == pytest.approx(1000 / 2 * 2e9 / HW.hbm_bytes_s + push + reprefill, rel=1e-9)
    # one-step-off pays the tail every step
    whole = simulate(batch, 2, engine, 1, 0, passes=1e-9, hw=HW)["one_step_off"][0]
    assert whole == pytest.approx(1000 * 2e9 / HW.hbm_bytes_s, rel=1e-6)


def test_the_32b_recipe_prints_a_labelled_simulation(capsys):
    out = main(["--batches", "1", "--gpus", "32", "--median-response", "500"])
    assert out["what"].startswith("a simulation") and out["sequences_per_step"] == 512 * 16
    assert out["colocated"]["speedup_vs_colocated"] == 1.0
    assert out["one_step_off"]["step_s"] <= out["sync"]["step_s"]
    assert out["fully_async_partial"]["speedup_vs_colocated"] > 0
    assert '"what": "a simulation' in capsys.readouterr().out
