"""The engine core, the KV cache and the schedulers import without torch.

They are meant to step under the fake executor (these conformance tests) and a simulator on machines with
no torch at all, so the check runs in a fresh interpreter in which importing torch raises ImportError.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from tests.conftest import REPO

BLOCKER = textwrap.dedent(
    """
    import sys

    class BlockTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"torch is blocked in this test (import of {name!r})")
            return None

    sys.meta_path.insert(0, BlockTorch())
    """
)


def run_without_torch(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", BLOCKER + code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


def test_blocker_really_blocks_torch() -> None:
    result = run_without_torch("import torch")
    assert result.returncode != 0 and "torch is blocked" in result.stderr


def test_core_kv_and_scheduling_import_without_torch() -> None:
    result = run_without_torch(
        "import bm.engine.step.core, bm.engine.execution.fake_executor, bm.scheduling, bm.kv\n"
        "assert not any(m == 'torch' or m.startswith('torch.') for m in sys.modules)\n"
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_a_conformance_case_runs_without_torch() -> None:
    result = run_without_torch(
        "from tests.conformance.cases_capacity import CASES\n"
        "from tests.conformance.harness import check_case, run_case\n"
        "case = next(c for c in CASES if c.name == 'SimpleDoesntFitGuaranteedCompletion')\n"
        "assert check_case(case, run_case(case)) == []\n"
    )
    assert result.returncode == 0, result.stderr[-3000:]
