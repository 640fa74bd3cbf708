"""The GPU campaign's `env` part: what this machine has, as one JSON line on stdout.

    python -m tools.gpu_env

Python, torch and its CUDA / cuDNN / NCCL builds, the devices, and for each package the
project may use: its installed version (or null) and, for the light ones, whether it really
imports (a wheel carried for another interpreter installs but fails here). vLLM and
Transformer Engine are only looked up, not imported: importing them costs seconds to minutes
and their absence is what the other parts need to know. Runs without CUDA too.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import platform
import sys

IMPORTED = {
    "megatron.core": "megatron-core",
    "transformers": "transformers",
    "tokenizers": "tokenizers",
    "safetensors": "safetensors",
    "datasets": "datasets",
    "pyarrow": "pyarrow",
    "fsspec": "fsspec",
    "huggingface_hub": "huggingface-hub",
    "yaml": "pyyaml",
    "psutil": "psutil",
    "math_verify": "math-verify",
    "pytest": "pytest",
    "megatron_rl.rollout.hf_engine": None,
}
"""Module -> distribution: imported to prove they work (None: part of this repository)."""

LOOKED_UP = {
    "vllm": "vllm",
    "transformer_engine": "transformer-engine",
    "flash_attn": "flash-attn",
    "apex": "apex",
    "ray": "ray",
}
"""Module -> distribution: version only (heavy to import, optional for the campaign)."""


def _version(dist: str | None) -> str | None:
    if dist is None:
        return None
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _imports(module: str) -> bool | str:
    """True, or the error's first line (why it does not import)."""
    try:
        importlib.import_module(module)
    except Exception as e:  # any failure is the answer, not a crash of the report
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    return True


def devices() -> list[dict]:
    import torch

    out = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        out.append(
            {
                "name": props.name,
                "capability": f"{props.major}.{props.minor}",
                "memory_gib": round(props.total_memory / 1024**3, 1),
                "multiprocessors": props.multi_processor_count,
            }
        )
    return out


def environment() -> dict:
    import torch

    cuda = torch.cuda.is_available()
    nccl = None
    if cuda and torch.distributed.is_nccl_available():
        nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
    return {
        "python": platform.python_version(),
        "executable": sys.executable,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "nccl": nccl,
        "cuda_available": cuda,
        "devices": devices() if cuda else [],
        "packages": {m: _version(d) for m, d in {**IMPORTED, **LOOKED_UP}.items()},
        "imports": {m: _imports(m) for m in IMPORTED},
    }


def main() -> int:
    print(json.dumps(environment()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
