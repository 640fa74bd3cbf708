"""Distributed tier: the benchmarks run end to end (their timings are not asserted:
performance is measured by the benchmarks themselves, never by tests)."""

import json
import subprocess
import sys

import pytest

from megatron_rl.launch import run_torchrun

pytestmark = pytest.mark.distributed


def test_bench_train_step_writes_one_result_line(tmp_path):
    out = tmp_path / "results.jsonl"
    args = [
        "--preset",
        "tiny",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--seq-length",
        "32",
        "--tp",
        "2",
        "--lora-rank",
        "8",
        "--without",
        "linear",
        "rope",
        "swiglu",
        "layer",
        "--out",
        str(out),
    ]
    run_torchrun("tools.bench_train_step", args, nproc=2)
    (line,) = out.read_text().splitlines()
    result = json.loads(line)
    assert result["layout"] == "TP2PP1DP1" and result["tokens_per_step"] == 4 * 32
    for key in ("ratio_ppo_over_plain", "plain_megatron_tokens_per_s", "ppo_update_tokens_per_s"):
        assert result[key] > 0
    assert result["lora_rank"] == 8 and result["ppo_update_lora_tokens_per_s"] > 0
    assert result["ratio_lora_over_ppo"] == pytest.approx(
        result["ppo_update_lora_s"] / result["ppo_update_s"], rel=0.03
    )
    assert result["peer"] == "none" and "peer_hf_s" not in result  # the peer runs on one device
    # the update with megatron-core's own beside it
    for part in ("linear", "rope", "swiglu", "layer"):
        assert result[f"speed_ppo_over_megatron_{part}"] == pytest.approx(
            result[f"ppo_update_megatron_{part}_s"] / result["ppo_update_s"], rel=0.03
        )


@pytest.mark.e2e  # ~25 s each, three processes: the journeys' tier keeps `make test` short
@pytest.mark.parametrize("mode", [pytest.param("--memory", marks=pytest.mark.extended), "--apart"])
def test_bench_train_step_runs_the_plain_pytorch_peer_and_each_arms_memory(tmp_path, mode):
    """One process: the transformers + SDPA + fused AdamW arm beside ours, and each arm's
    peak memory measured alone in a child process (`--apart`: its speed too); the update
    with the head's tile sums compiled, and with its logits recomputed, among them."""
    out = tmp_path / "results.jsonl"
    args = ["--preset", "tiny", "--steps", "1", "--warmup", "0", "--seq-length", "32"]
    args += ["--lora-rank", "8", "--compiled-head-forward", "--logits-checkpointing"]
    run_torchrun("tools.bench_train_step", [*args, mode, "--out", str(out)], nproc=1)
    (line,) = out.read_text().splitlines()
    result = json.loads(line)
    assert result["peer"] == "fp32" and result["layout"] == "TP1PP1DP1"
    assert result["arms"] == ("apart" if mode == "--apart" else "alternating")
    arms = ("plain_megatron", "ppo_update", "ppo_update_compiled_head_forward")
    arms += ("ppo_update_logits_checkpointing",)
    for arm in (*arms, "ppo_update_lora", "peer_hf"):
        assert result[f"{arm}_tokens_per_s"] > 0 and result[f"{arm}_peak_gib"] > 0
    assert result["speed_compiled_head_forward_over_eager"] == pytest.approx(
        result["ppo_update_s"] / result["ppo_update_compiled_head_forward_s"], rel=0.03
    )
    assert result["speed_kept_probs_over_logits_checkpointing"] == pytest.approx(
        result["ppo_update_logits_checkpointing_s"] / result["ppo_update_s"], rel=0.03
    )
    assert result["memory_lora_over_ppo"] == pytest.approx(
        result["ppo_update_lora_peak_gib"] / result["ppo_update_peak_gib"], rel=0.03
    )
    # the ratios are of the unrounded figures; the printed ones are rounded (4 decimals)
    assert result["speed_ppo_over_peer"] == pytest.approx(
        result["peer_hf_s"] / result["ppo_update_s"], rel=0.03
    )
    assert result["memory_ppo_over_peer"] == pytest.approx(
        result["ppo_update_peak_gib"] / result["peer_hf_peak_gib"], rel=0.03
    )


def test_bench_long_cot_writes_one_result_line(tmp_path):
    from tools.bench_long_cot import long_tailed_lengths

    lengths = long_tailed_lengths(400, median=256, sigma=1.0, max_length=2048)
    assert lengths[0] == max(lengths) == 2048 and min(lengths) >= 1
    assert 200 <= sorted(lengths)[200] <= 320  # lognormal around its median
    out = tmp_path / "results.jsonl"
    small = ["--rows", "8", "--median", "24", "--max-length", "96", "--prompt-length", "8"]
    run_torchrun(
        "tools.bench_long_cot",
        [*small, "--steps", "1", "--warmup", "0", "--out", str(out)],
        nproc=1,
    )
    (line,) = out.read_text().splitlines()
    result = json.loads(line)
    assert result["max_tokens_per_micro_batch"] == 2 * (8 + 96)
    assert result["padded_micro_batches"] == 4 and result["padded_padded_tokens"] == 8 * 104
    # the same rows in fewer micro-batches, with less padding, never under the real tokens
    assert result["token_budget_micro_batches"] < 4
    assert result["real_tokens"] <= result["token_budget_padded_tokens"] < 8 * 104
    assert result["speedup_token_budget_over_padded"] > 0
    # packed: exactly the real tokens, no padding at all
    assert result["packed_padded_tokens"] == result["real_tokens"]
    assert result["packed_tokens_over_real"] == 1.0 and result["speedup_packed_over_padded"] > 0
    # the plain-PyTorch peer pads every row to the longest, as the padded arm does
    assert result["peer"] == "fp32" and result["peer_padded_tokens_over_real"] > 1
    assert result["peer_padded_tokens_per_s"] > 0 and result["speedup_packed_over_peer"] > 0


@pytest.mark.e2e  # ~50 s of Ray start-up and scoring: the journeys' tier
def test_bench_rewards_writes_one_result_line(tmp_path):
    """Both backends inline and through a 1-worker Ray pool, on 48 MATH-style samples."""
    from tools.bench_rewards import main

    out = tmp_path / "results.jsonl"
    main(["--samples", "48", "--batch-size", "24", "--workers", "1", "--out", str(out)])
    (line,) = out.read_text().splitlines()
    result = json.loads(line)
    for arm in ("fast_inline", "fast_ray", "math_verify_inline", "math_verify_ray"):
        assert result[f"{arm}_samples_per_s"] > 0
    # symbolic checking finds every right answer right; the fast rules a third of them
    assert result["math_verify_right_found_right"] == 1.0
    assert result["fast_right_found_right"] == pytest.approx(1 / 3, abs=0.01)
    assert result["math_verify_wrong_found_right"] == result["fast_wrong_found_right"] == 0


def test_weight_sync_and_generate_benchmarks_write_their_lines(tmp_path):
    """Both in one process (one vLLM import): the tiny preset, one timed step each."""
    out = tmp_path / "results.jsonl"
    code = (
        "from tools import bench\n"
        f"bench.main(['generate', '--preset', 'tiny', '--steps', '1', '--out', {str(out)!r}])\n"
        "bench.main(['weight_sync', '--preset', 'tiny', '--steps', '1', '--lora-rank', '8',"
        f" '--out', {str(out)!r}])\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    generate, sync = map(json.loads, out.read_text().splitlines())
    assert generate["bench"] == "generate" and sync["bench"] == "weight_sync"
    # Both arms did the same work: every sample ran to max_new_tokens.
    assert generate["generated_tokens"] == {"vllm": 8 * 4 * 32, "hf": 8 * 4 * 32}
    assert generate["ratio_vllm_over_hf_tokens_per_s"] > 0
    assert sync["gb_moved"] > 0 and 0 < sync["export_share_of_sync"]
    assert sync["memcpy_gb_per_s"] > 0 and sync["sync_gb_per_s"] > 0
    # a LoRA policy's merged sync beside the plain one
    assert sync["lora_rank"] == 8 and sync["sync_lora_gb_per_s"] > 0
    assert sync["ratio_sync_lora_over_sync_s"] == pytest.approx(
        sync["sync_lora_s"] / sync["sync_s"], rel=0.05
    )
    assert 0 < sync["ratio_sync_lora_adapted_over_sync_lora_s"]
    # the adapters alone (their load forced by a score, timed apart and taken off)
    assert sync["sync_adapter_s"] > 0 and sync["score_s"] > 0
    assert "sync_adapter_gb_per_s" not in sync  # it moves the adapters, not the model
    assert sync["generated_tokens"]["generate_adapter"] > 0
    assert sync["ratio_generate_adapter_over_merged_tokens_per_s"] > 0
    assert sync["ratio_sync_adapter_over_sync_lora_s"] == pytest.approx(
        (sync["sync_adapter_s"] - sync["score_s"]) / sync["sync_lora_s"], rel=0.05, abs=1e-3
    )


def test_bench_entry_lists_and_refuses_unknown_names(capsys):
    from tools.bench import BENCHMARKS, main

    assert main(["list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in BENCHMARKS)
    assert main(["nope"]) == 2 and "unknown benchmark 'nope'" in capsys.readouterr().err


@pytest.mark.extended  # its planner and to-bar maths: tests/tools/test_bench_unit.py
@pytest.mark.e2e  # four short training runs: the journeys' tier
def test_bench_async_times_each_placement_against_colocated(tmp_path):
    """The baseline and one-step-off apart (apart_k0's runs are the disaggregated e2e
    tests'); each mode's ratio is the baseline's step over its own; the --to-bar runs
    evaluate."""
    from tools.bench_async import main

    out = tmp_path / "results.jsonl"
    modes = "colocated,apart_k1"
    main(["--model", str(tmp_path / "absent"), "--steps", "3", "--modes", modes, "--out", str(out),
          "--to-bar", "--bar-steps", "1", "--eval-interval", "1"])  # fmt: skip
    (line,) = out.read_text().splitlines()
    result = json.loads(line)
    assert result["model"] == "fresh tiny random" and result["steps_measured"] == 2
    for mode in ("colocated", "apart_k1"):
        assert result[mode]["step_s"] > 0 and result[mode]["response_length"] > 0
    want = round(result["colocated"]["step_s"] / result["apart_k1"]["step_s"], 3)
    assert result["apart_k1"]["ratio_to_colocated"] == want
    assert result["apart_k1"]["staleness"] == 1.0 and "staleness" not in result["colocated"]
    assert "ideal_ratio_k1_over_k0" not in result  # it needs the synchronous apart run
    # --to-bar: the recipe's value pretraining and an evaluation after its one step; a
    # random model answers about 1% right, far from the bar
    assert result["to_bar"] == {"min_gain": 0.25, "steps": 1, "seed": 0, "eval_interval": 1}
    for mode in ("colocated", "apart_k1"):
        assert 0 <= result[mode]["accuracy_before"] < 0.1
        assert 0 <= result[mode]["accuracy_end"] < 0.1
        assert result[mode]["steps_to_bar"] is None and result[mode]["time_to_bar_s"] is None
