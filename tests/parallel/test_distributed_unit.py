"""Unit tier: parallel-layout validation and the CPU compatibility layer."""

import pytest
import torch

from megatron_rl.models.hf_config import read_hf_config
from megatron_rl.parallel import cpu_compat, distributed
from megatron_rl.parallel.distributed import ParallelLayout


def test_world_size_not_divisible_names_the_numbers():
    with pytest.raises(ValueError, match=r"world size 3 .* 2 \* 1 = 2"):
        ParallelLayout(tensor_model_parallel_size=2).validate(world_size=3)


def test_tp_must_divide_heads_and_kv_heads(tiny_model_dir):
    arch = read_hf_config(tiny_model_dir)  # 4 heads, 2 KV heads
    with pytest.raises(
        ValueError, match="tensor_model_parallel_size=4 does not divide num_key_value_heads=2"
    ):
        ParallelLayout(tensor_model_parallel_size=4).validate(world_size=4, arch=arch)
    with pytest.raises(
        ValueError, match="tensor_model_parallel_size=3 does not divide num_attention_heads=4"
    ):
        ParallelLayout(tensor_model_parallel_size=3).validate(world_size=3, arch=arch)


def test_layers_must_split_over_pipeline_chunks(tiny_model_dir):
    arch = read_hf_config(tiny_model_dir)  # 4 layers
    layout = ParallelLayout(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=4)
    with pytest.raises(ValueError, match="num_hidden_layers=4 is not divisible by .* = 8"):
        layout.validate(world_size=2, arch=arch)
    ParallelLayout(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2).validate(
        2, arch
    )


MOE_CONFIG = {
    "model_type": "qwen3_moe", "num_hidden_layers": 2, "hidden_size": 128,
    "intermediate_size": 256, "moe_intermediate_size": 64, "num_experts": 8,
    "num_experts_per_tok": 2, "norm_topk_prob": True, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 500,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-6,
}  # fmt: skip


@pytest.mark.parametrize(
    "layout, world, message",
    [
        (
            dict(expert_model_parallel_size=3),
            3,
            "expert_model_parallel_size=3 does not divide the 8 experts",
        ),
        (
            dict(
                tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=3
            ),
            6,
            "expert_tensor_parallel_size=3 does not divide the experts' intermediate size 64",
        ),
        (
            dict(expert_model_parallel_size=4),
            2,
            r"world size 2 is not divisible by .* 1 \* 4 \* 1 = 4",
        ),
        (dict(tensor_model_parallel_size=2), 2, "needs sequence_parallel=True"),
        (dict(expert_model_parallel_size=0), 2, "expert_model_parallel_size must be a positive"),
    ],
)
def test_expert_layouts_are_checked_against_the_experts(layout, world, message):
    arch = read_hf_config(MOE_CONFIG)
    with pytest.raises(ValueError, match=message):
        ParallelLayout(**layout).validate(world, arch)
    # what megatron-core runs on two ranks: EP=2 (ETP 1), and TP=2+SP with EP=2, ETP=1
    ParallelLayout(expert_model_parallel_size=2).validate(2, arch)
    ParallelLayout(
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        expert_model_parallel_size=2,
        expert_tensor_parallel_size=1,
    ).validate(2, arch)


def test_expert_parallelism_of_a_dense_model_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="the model is dense"):
        ParallelLayout(expert_model_parallel_size=2).validate(2, read_hf_config(tiny_model_dir))


@pytest.mark.parametrize(
    "layout, message",
    [
        (
            ParallelLayout(sequence_parallel=True),
            "sequence_parallel=True needs tensor_model_parallel_size >= 2",
        ),
        (
            ParallelLayout(virtual_pipeline_model_parallel_size=2),
            "needs pipeline_model_parallel_size >= 2",
        ),
        (
            ParallelLayout(tensor_model_parallel_size=0),
            "tensor_model_parallel_size must be a positive integer",
        ),
        (ParallelLayout(context_parallel_size=2), "context_parallel_size=2 is not supported"),
    ],
)
def test_bad_layouts(layout, message):
    with pytest.raises(ValueError, match=message):
        layout.validate(world_size=4)


def test_bad_layout_fails_before_any_process_group(monkeypatch, tiny_model_dir):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="world size 3"):
        distributed.initialize(ParallelLayout(tensor_model_parallel_size=2))
    assert not torch.distributed.is_initialized()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU layer is inert with CUDA")
def test_cpu_compat_maps_cuda_factories_only_inside_megatron_schedules():
    assert cpu_compat.apply() is True
    assert cpu_compat.apply() is True  # idempotent
    assert torch.cuda.current_device() == "cpu"
    with cpu_compat.CudaToCpuDeviceMode():
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.ones(2, device=torch.device("cuda", 0)).device.type == "cpu"
        t = torch.ones(2)
        assert t.cuda() is t
    from megatron.core.fusions import fused_softmax
    from megatron.core.pipeline_parallel import schedules

    assert getattr(schedules.forward_backward_no_pipelining, "__megatron_rl_cpu_compat__", False)
    mask = fused_softmax.get_default_causal_mask(4)
    assert mask.device.type == "cpu" and mask.dtype == torch.bool
    assert mask.tolist()[0] == [False, True, True, True]
    # Outside the wrapped calls, "cuda" still means CUDA (and fails here): nothing global.
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU layer is inert with CUDA")
def test_cpu_compat_lifts_its_mode_around_the_models_forward_and_backward():
    """Inside a schedule, megatron's forward_step and backward_step run without the device
    mode (its Python call on every op is what it would cost); the mask builders they may call
    keep their own scope, and the schedule has its mode back afterwards."""
    from megatron.core.fusions import fused_softmax
    from megatron.core.pipeline_parallel import schedules
    from torch.overrides import _get_current_function_mode

    assert cpu_compat.apply() is True
    for name in ("forward_step", "backward_step"):
        assert getattr(getattr(schedules, name), "__megatron_rl_cpu_compat__", False), name

    def step():
        mode = _get_current_function_mode()
        return mode, fused_softmax.get_default_causal_mask(3)

    lifted = cpu_compat._without_device_mode(step)
    with cpu_compat.CudaToCpuDeviceMode() as outer:
        mode, mask = lifted()
        assert mode is None
        assert mask.device.type == "cpu"
        assert _get_current_function_mode() is outer
        assert torch.zeros(1, device="cuda").device.type == "cpu"
    assert lifted()[0] is None  # outside any mode: runs as it is


def test_two_lone_processes_on_one_host_initialise_at_once(tmp_path):
    """A process outside torchrun (a warm start, a tool) picks a free rendezvous port: two at
    once both held the fixed 29500 before (EADDRINUSE)."""
    import os
    import subprocess
    import sys

    code = (
        "import sys, time; from pathlib import Path; from megatron_rl.parallel import distributed; "
        "distributed.initialize(distributed.ParallelLayout()); Path(sys.argv[1]).touch(); "
        "[time.sleep(0.1) for _ in range(600) if len(list(Path(sys.argv[1]).parent.iterdir())) < 2]; "
        "distributed.destroy()"
    )  # each holds its process group until both are up
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "WORLD_SIZE", "RANK")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path / f"up{i}")],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors


@pytest.mark.parametrize("version", ["0.16.0", "0.16.1", "0.16"])
def test_cpu_compat_accepts_the_megatron_core_it_was_written_for(version):
    cpu_compat.check_megatron_version(version)


@pytest.mark.parametrize("version", ["0.15.3", "0.17.0", "0.160.0", "1.0.0"])
def test_cpu_compat_refuses_another_megatron_core_by_name(version):
    with pytest.raises(
        RuntimeError, match=f"written for megatron-core 0.16.x, but megatron-core {version}"
    ):
        cpu_compat.check_megatron_version(version)
