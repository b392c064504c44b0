"""benchmarks/engine_host.py: the host's time per iteration over the fake executor and over the torch
executor on the GPU's code path with its model call stubbed (run apart: the stub patches the runtime)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO
from tests.hang import HANG_S


def _engine_host(executor: str, sampling: str = "greedy") -> dict:
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "engine_host.py"), "--requests", "8", "--overlap", "off,on",
         "--repeats", "1", "--executor", executor, "--sampling", sampling],
        cwd=REPO, capture_output=True, text=True, timeout=HANG_S, check=True,
    )  # fmt: skip
    return json.loads(done.stdout)


def test_the_stubbed_torch_executor_runs_the_fake_executors_iterations_on_the_gpu_code_path():
    """The same workload and scheduler: as many iterations over either executor, greedy or sampling
    (the stub never offers an end token), with overlap off and on (on: one more, the discarded step of
    the requests ending together); every figure positive."""
    fake, torch_path = _engine_host("fake"), _engine_host("torch")
    sampled = _engine_host("torch", "sampled")
    assert torch_path["workload"]["executor"] == "torch" and sampled["workload"]["sampling"] == "sampled"
    iterations = {}
    for report in (fake, torch_path, sampled):
        for row in report["results"]:
            assert row["core_ms_per_iteration"]["median"] > 0 and row["decode_core_ms"]["median"] > 0
            iterations.setdefault(row["overlap"], set()).add(row["iterations"])
    assert len(iterations["off"]) == 1 and len(iterations["on"]) == 1
    assert iterations["on"] == {next(iter(iterations["off"])) + 1}
