"""The device policy, checked on the source: every tensor the package creates names its device.

Our tests run on CPU, where a tensor made without a device lands where everything else is,
so a forgotten `device=` passes every CPU test and fails on the first GPU step (a CPU count
in an NCCL all-reduce, a CPU index mixed with CUDA log-probs). The rule (docs/layouts.md, "Devices"):
- a batch is built in host memory and moved whole where it enters a role or the experience
  maker (`TrainingBatch.to`, `MegatronRole.device`);
- metadata that crosses ranks is made on `platform.device()` (CUDA under NCCL);
- everything else is made on the device of the tensor it belongs with (`device=x.device`,
  `x.new_zeros`), or says `device="cpu"` where it is host-side on purpose.
`*_like` and `Tensor.new_*` inherit their device and are not factories here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from megatron_rl.data.batch import TrainingBatch

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_rl"
FACTORIES = frozenset({
    "tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "linspace", "logspace",
    "eye", "rand", "randn", "randint", "randperm", "empty_strided", "tril_indices",
    "triu_indices",
})  # fmt: skip
ALLOWED: dict[tuple[str, str], str] = {}
"""(path under megatron_rl/, source of the call) -> why it may leave its device unnamed.
Empty today: every factory names one. An entry needs its reason, and one that no longer
matches a call fails the test, so the list cannot outlive its cause."""


def deviceless_factories(source: str) -> list[tuple[int, str]]:
    """(line, call) of each `torch.<factory>(...)` call without a `device=` keyword."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "torch"
            and node.func.attr in FACTORIES
            and not any(k.arg == "device" for k in node.keywords)
        ):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_scan_finds_a_factory_without_a_device():
    source = (
        "import torch\n"
        "a = torch.zeros(3, dtype=torch.long)\n"
        "b = torch.tensor([1], device=x.device)\n"
        "c = torch.zeros_like(a)\n"
        "d = torch.arange(4)\n"
    )
    assert deviceless_factories(source) == [
        (2, "torch.zeros(3, dtype=torch.long)"),
        (5, "torch.arange(4)"),
    ]


def test_every_tensor_the_package_creates_names_its_device():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 80  # the whole package, not an empty glob
    offenders, allowed_seen = [], set()
    for path in files:
        rel = str(path.relative_to(PACKAGE))
        for line, call in deviceless_factories(path.read_text()):
            if (rel, call) in ALLOWED:
                allowed_seen.add((rel, call))
            else:
                offenders.append(f"megatron_rl/{rel}:{line}: {call}")
    assert not offenders, "tensors created without a device:\n" + "\n".join(offenders)
    assert allowed_seen == set(ALLOWED), f"stale allow-list entries: {set(ALLOWED) - allowed_seen}"


def test_a_batch_moves_whole_and_indexes_on_its_own_device():
    batch = TrainingBatch(
        input_ids=torch.arange(12, device="cpu").reshape(3, 4),
        response_mask=torch.ones(3, 4, device="cpu"),
        scores=torch.zeros(3, device="cpu"),
    )
    assert batch.to("cpu") is batch  # already there: no copy
    moved = batch.to("meta")
    assert {v.device.type for v in vars(moved).values() if v is not None} == {"meta"}
    # a host-side index (a CPU shuffle's permutation) selects rows of a batch elsewhere
    rows = moved.rows(torch.tensor([2, 0], device="cpu"))
    assert rows.input_ids.device.type == "meta" and rows.input_ids.shape == (2, 4)
