"""Unit tier: the package's layering, read from the source with `ast` (nothing is imported).

Four rules over every module of `megatron_rl/`:

(a) no import cycle between modules, counting imports inside functions too (a function-level
    import hides a cycle from Python, not from the design);
(b) no upward import: each module sits in a layer (`LAYERS`, lowest first; a module takes the
    layer of the longest name that covers it) and imports only from its own layer or below;
(c) a function-level import says why in a comment on its line or on the line above it (or
    above the run of imports it belongs to; `# why: ...`, a `# noqa` is no reason): only a
    heavy or optional dependency (megatron-core, transformers, vLLM, ray, ...) or a
    deliberate start-up-time choice is imported late;
(d) no import of `examples`, `tools` or `tests`: they are not installed.

Imports under `if TYPE_CHECKING:` count for (b) and (c) as any other (a type is a dependency
too) but not for (a), since they never run.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "megatron_rl"

LAYERS: list[tuple[str, ...]] = [
    # leaves: the standard library and torch only
    (
        "megatron_rl",
        "megatron_rl.child_process",
        "megatron_rl.cpu_math",
        "megatron_rl.fsutil",
        "megatron_rl.numerics",
        "megatron_rl.procutil",
        "megatron_rl.plugins",
        "megatron_rl.preemption",
        "megatron_rl.stack",
        # the generic YAML / key=value loader, once config.py is a package (names no section)
        "megatron_rl.config.loader",
    ),
    # maths on tensors and the training batch
    ("megatron_rl.algorithms", "megatron_rl.data"),
    # the layout, process bring-up, collectives, the CPU compatibility layer
    ("megatron_rl.parallel",),
    ("megatron_rl.models",),
    ("megatron_rl.workers",),
    ("megatron_rl.rewards",),
    ("megatron_rl.envs",),
    ("megatron_rl.rollout",),
    ("megatron_rl.sync", "megatron_rl.memory_plan", "megatron_rl.launch"),
    # the run's config and its validation (names every piece above), with the trainer's
    # pieces it validates against
    ("megatron_rl.config", "megatron_rl.trainer.loggers"),
    # the rollout side as the trainer sees it, one interface for both placements (it reads
    # the run's config and pushes weights through `sync`)
    ("megatron_rl.rollout.service",),
    ("megatron_rl.trainer",),
    ("megatron_rl.cli",),
]
"""Lowest first. A name stands for the module and everything under it."""

KNOWN_UPWARD: dict[tuple[str, str], str] = {}
"""(importer, imported) pairs allowed to break (b), each with the reason it is left."""

TRAINER_SEES_OF_ROLLOUT = ("megatron_rl.rollout.service", "megatron_rl.rollout.types")
"""All the trainer may import of the rollout side: the service's package (its `__init__`
names) and the engine-neutral types. Neither engines, wrappers, rating, the engine ranks'
loop nor the wire protocol: whatever the placement, the trainer holds a `RolloutService`."""


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    path: Path
    line: int
    in_function: bool
    type_only: bool


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules(root: Path, package: str) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The package module `name` is, or is inside of (`pkg.mod.func` -> `pkg.mod`)."""
    while name not in modules:
        if "." not in name:
            return None
        name = name.rsplit(".", 1)[0]
    return name


def imports_of(name: str, path: Path, modules: dict[str, Path], package: str) -> list[Import]:
    """Every import of a package module by module `name`, with where it is."""
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                if isinstance(child, ast.Import):
                    targets = [a.name for a in child.names]
                else:
                    base = child.module or ""
                    if child.level:  # relative: resolve against this module's package
                        anchor = name.split(".")
                        anchor = anchor[: len(anchor) - child.level + (path.stem == "__init__")]
                        base = ".".join([*anchor, base] if base else anchor)
                    # `from pkg import mod` imports the module pkg.mod; `from mod import f`, mod
                    targets = [f"{base}.{a.name}" for a in child.names]
                for target in targets:
                    if not (target == package or target.startswith(package + ".")):
                        continue
                    resolved = _resolve(target, modules)
                    if resolved is not None and resolved != name:
                        found.append(
                            Import(name, resolved, path, child.lineno, in_function, type_only)
                        )
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                visit(child, True, type_only)
            elif isinstance(child, ast.If) and _is_type_checking(child):
                for stmt in child.body:
                    visit(ast.Module(body=[stmt], type_ignores=[]), in_function, True)
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]), in_function, type_only)
            else:
                visit(child, in_function, type_only)

    visit(ast.parse(path.read_text(), str(path)), False, False)
    return found


def all_imports(root: Path, package: str) -> list[Import]:
    modules = package_modules(root, package)
    return [i for name, path in modules.items() for i in imports_of(name, path, modules, package)]


def import_cycles(imports: list[Import]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted; run-time
    imports only."""
    graph: dict[str, set[str]] = {}
    for i in imports:
        if not i.type_only:
            graph.setdefault(i.importer, set()).add(i.imported)
            graph.setdefault(i.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(cycles)


def layer_of(module: str, layers: list[tuple[str, ...]]) -> int:
    """The layer of the longest declared name that is `module` or a package above it."""
    best: tuple[int, int] | None = None
    for level, names in enumerate(layers):
        for n in names:
            if module == n or module.startswith(n + "."):
                if best is None or len(n) > best[0]:
                    best = (len(n), level)
    if best is None:
        raise LookupError(f"{module} is in no layer: add it to LAYERS")
    return best[1]


def upward_imports(
    imports: list[Import],
    layers: list[tuple[str, ...]],
    allowed: dict[tuple[str, str], str] | None = None,
) -> list[str]:
    allowed = allowed or {}
    bad = []
    for i in imports:
        low, high = layer_of(i.importer, layers), layer_of(i.imported, layers)
        if high > low and (i.importer, i.imported) not in allowed:
            bad.append(f"{i.path.name}:{i.line}: {i.importer} (layer {low}) imports "
                       f"{i.imported} (layer {high})")  # fmt: skip
    return bad


def reaches_into(
    imports: list[Import], importer: str, side: str, sees: tuple[str, ...]
) -> list[str]:
    """Imports by modules under `importer` of modules under `side` other than `sees`
    exactly (a package's own names, not its modules)."""
    return [
        f"{i.path.name}:{i.line}: {i.importer} imports {i.imported}"
        for i in imports
        if (i.importer == importer or i.importer.startswith(importer + "."))
        and (i.imported == side or i.imported.startswith(side + "."))
        and i.imported not in sees
    ]


def imports_of_outside(root: Path, package: str, forbidden: tuple[str, ...]) -> list[str]:
    """Imports (anywhere in a module) of top-level packages the library must not need: the
    examples, the tools and the tests run from the repository root and are not installed."""
    bad = []
    for path in sorted((root / package).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            bad += [f"{rel}:{node.lineno}: {n}" for n in names if n.split(".")[0] in forbidden]
    return bad


PRAGMAS = ("noqa", "type:", "fmt:", "pragma", "pyright:")
"""Comments that are tool directives, not reasons."""


def _reason(line: str) -> bool:
    """Whether `line` carries a comment that gives a reason (`# why: ...`, or any comment
    that is not a tool directive)."""
    if "#" not in line:
        return False
    comment = line.split("#", 1)[1].strip()
    return bool(comment) and not comment.startswith(PRAGMAS)


def _unexplained_in(rel: str, text: str) -> list[str]:
    lines = text.splitlines()

    def why_above(node: ast.stmt) -> bool:
        above = lines[node.lineno - 2].strip() if node.lineno >= 2 else ""
        return above.startswith("#") and _reason(above)

    bad: list[str] = []

    def check(body: list[ast.stmt], in_function: bool) -> None:
        run: list[ast.stmt] = []  # consecutive imports: a `# why` above the first covers all
        for stmt in body:
            if isinstance(stmt, ast.Import | ast.ImportFrom):
                run = [*run, stmt]
                own = _reason(lines[stmt.lineno - 1]) or why_above(stmt)
                if in_function and not own and not why_above(run[0]):
                    bad.append(f"{rel}:{stmt.lineno}: {lines[stmt.lineno - 1].strip()}")
                continue
            run = []
            inner = in_function or isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef)
            for field in ("body", "orelse", "finalbody"):
                if isinstance(getattr(stmt, field, None), list):
                    check(getattr(stmt, field), inner)
            for handler in getattr(stmt, "handlers", []):
                check(handler.body, inner)

    check(ast.parse(text, rel).body, False)
    return bad


def unexplained_late_imports(root: Path, package: str) -> list[str]:
    """Function-level imports (of anything) without a `# why` on their line, on the line above,
    or above the first of the run of consecutive imports they belong to."""
    bad = []
    for path in sorted((root / package).rglob("*.py")):
        bad += _unexplained_in(path.relative_to(root).as_posix(), path.read_text())
    return sorted(set(bad))


# ---- the package itself ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    return all_imports(ROOT, PACKAGE)


def test_no_import_cycle(imports):
    assert import_cycles(imports) == []


def test_no_upward_import(imports):
    assert upward_imports(imports, LAYERS, KNOWN_UPWARD) == []


def test_every_module_has_a_layer():
    for name in package_modules(ROOT, PACKAGE):
        layer_of(name, LAYERS)


def test_the_library_imports_no_examples_tools_or_tests():
    assert imports_of_outside(ROOT, PACKAGE, ("examples", "tools", "tests")) == []


def test_the_trainer_sees_only_the_rollout_service_and_its_types(imports):
    trainer = f"{PACKAGE}.trainer"
    assert reaches_into(imports, trainer, f"{PACKAGE}.rollout", TRAINER_SEES_OF_ROLLOUT) == []
    assert imports_of_outside(ROOT, f"{PACKAGE}/trainer", ("vllm",)) == []


def test_every_late_import_says_why():
    assert unexplained_late_imports(ROOT, PACKAGE) == []


# ---- each check can fail: a small synthetic package ---------------------------------------------


def write_package(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
    write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/low/__init__.py": "",
        "pkg/low/a.py": "from pkg.low import b\n",
        "pkg/low/b.py": "def f():\n    from pkg.low.a import g  # why: hides the cycle\n",
        "pkg/low/c.py": "import pkg.low.a\n",
    })  # fmt: skip
    assert import_cycles(all_imports(tmp_path, "pkg")) == [["pkg.low.a", "pkg.low.b"]]


def test_a_type_checking_import_makes_no_cycle(tmp_path):
    write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg import b\n",
        "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n",
    })  # fmt: skip
    assert import_cycles(all_imports(tmp_path, "pkg")) == []


def test_an_upward_import_is_found_even_inside_a_function(tmp_path):
    write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/low/__init__.py": "",
        "pkg/low/a.py": "def f():\n    from pkg.high.b import g  # why: late\n",
        "pkg/high/__init__.py": "",
        "pkg/high/b.py": "from pkg.low.a import f\n\ndef g():\n    pass\n",
    })  # fmt: skip
    layers = [("pkg", "pkg.low"), ("pkg.high",)]
    bad = upward_imports(all_imports(tmp_path, "pkg"), layers)
    assert bad == ["a.py:2: pkg.low.a (layer 0) imports pkg.high.b (layer 1)"]
    assert upward_imports(all_imports(tmp_path, "pkg"), layers, {("pkg.low.a", "pkg.high.b"): ""})\
        == []  # fmt: skip


def test_the_longest_layer_name_wins():
    layers = [("pkg", "pkg.low", "pkg.top.leaf"), ("pkg.top",)]
    assert layer_of("pkg.top.leaf", layers) == 0
    assert layer_of("pkg.top.other", layers) == 1
    with pytest.raises(LookupError, match="other.mod is in no layer"):
        layer_of("other.mod", layers)


def test_a_late_import_without_a_why_is_found(tmp_path):
    write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": (
            "import json\n\n"
            "def f():\n"
            "    import torch\n"
            "    # why: seconds to import\n"
            "    import vllm\n"
            "    import ray  # why: optional\n"
            "    import numpy\n\n"
            "def g():\n"
            "    # why: one reason for the block\n"
            "    import torch\n"
            "    import vllm\n"
            "    x = 1\n"
            "    import json\n"
            "    import yaml  # noqa: F401\n"
        ),
        "pkg/sub/b.py": "def f():\n    import torch\n",
    })  # fmt: skip
    assert unexplained_late_imports(tmp_path, "pkg") == [
        "pkg/a.py:15: import json",
        "pkg/a.py:16: import yaml  # noqa: F401",
        "pkg/a.py:4: import torch",
        "pkg/a.py:8: import numpy",
        "pkg/sub/b.py:2: import torch",
    ]


def test_a_reach_into_a_side_s_internals_is_found(tmp_path):
    write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/side/__init__.py": "",
        "pkg/side/service/__init__.py": "def f():\n    pass\n",
        "pkg/side/service/engine.py": "",
        "pkg/side/types.py": "",
        "pkg/user/__init__.py": "",
        "pkg/user/a.py": (
            "from pkg.side.service import f\nfrom pkg.side import types\n\n"
            "def g():\n    from pkg.side.service import engine  # why: late\n"
        ),
    })  # fmt: skip
    sees = ("pkg.side.service", "pkg.side.types")
    found = all_imports(tmp_path, "pkg")
    assert reaches_into(found, "pkg.user", "pkg.side", sees) == [
        "a.py:5: pkg.user.a imports pkg.side.service.engine"
    ]
    assert reaches_into(found, "pkg.user", "pkg.side", (*sees, "pkg.side.service.engine")) == []


def test_an_import_of_the_examples_is_found(tmp_path):
    write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "import json\n\ndef f():\n    from examples.tiny_model import make  # why: x\n",
    })  # fmt: skip
    found = imports_of_outside(tmp_path, "pkg", ("examples", "tools"))
    assert found == ["pkg/a.py:4: examples.tiny_model"]
