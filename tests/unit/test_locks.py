"""The lock files: every dependency of pyproject.toml pinned to one release that satisfies its
floor, and the installs (`make install`, CI, the image) taking their releases from them."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
#: Which lock holds the pins of which extras (the core dependencies are in both).
LOCKS = {"cpu": ("cpu", "dev"), "gpu": ("gpu",)}


def pins(lock: str) -> dict[str, str]:
    """``{canonical name: version}`` of ``requirements/<lock>.lock``."""
    text = (ROOT / "requirements" / f"{lock}.lock").read_text()
    found = re.findall(r"^([A-Za-z0-9._-]+)==(\S+)", text, flags=re.MULTILINE)
    return {canonicalize_name(name): version for name, version in found}


@pytest.mark.parametrize("lock", sorted(LOCKS))
def test_every_dependency_is_pinned_within_its_floor(lock: str) -> None:
    pinned = pins(lock)
    extras = PYPROJECT["project"]["optional-dependencies"]
    wanted = [*PYPROJECT["project"]["dependencies"]]
    for extra in LOCKS[lock]:
        wanted += extras[extra]
    stale = []
    for line in wanted:
        requirement = Requirement(line)
        version = pinned.get(canonicalize_name(requirement.name))
        if version is None or not requirement.specifier.contains(version, prereleases=True):
            stale.append(f"{line}: locked {version}")
    assert stale == [], f"run `make lock`: {stale}"


def test_installs_take_their_releases_from_the_locks() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "-c requirements/cpu.lock -e '.[cpu,dev]'" in makefile
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert '-c "requirements/${OFFPEAK_EXTRA}.lock"' in dockerfile
    assert "COPY requirements requirements" in dockerfile
