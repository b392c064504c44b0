"""A script of ``benchmarks/`` loaded as a module, for the tests that keep each script from rotting on the
CPU. The scripts run from that folder and import each other by bare name (``from common import ...``),
so the folder is on the path while one loads."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from tests.conftest import REPO

BENCHMARKS = REPO / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as the module ``name`` (registered before it runs: a dataclass looks its
    module up while the class is made)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module
