"""The engine's worker thread is the only thread holding an OpenMP team once an engine starts.

A model loads on the caller's thread, which leaves that thread an OpenMP team; without the hand-over the
worker's team made the runtime manage more threads than the machine has CPUs, and GNU OpenMP then puts
idle team members to sleep after a few spins, so each small forward on the worker paid a wake-up per
parallel region (2x a decode step on a 2-core machine). These tests pin the mechanism, not a time."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from bm.config import BmConfig
from bm.engine.driving.loop import EngineLoop
from bm.engine.execution.fake_executor import FakeExecutor
from bm.engine.requests.request import Request
from bm.runtime.native.build import loaded_openmp_runtime
from tests.hang import HANG_S


def _gnu_openmp() -> bool:
    path = loaded_openmp_runtime()
    return path is not None and path.name.startswith("libgomp") and Path("/proc/self/task").is_dir()


_CHECK = """
import os, time, torch
from bm.runtime.threads import release_caller_team
def threads(): return len(os.listdir("/proc/self/task"))
torch.set_num_threads(2)
torch.randn(256, 256) @ torch.randn(256, 256)
with_team = threads()
released = release_caller_team()
# the released worker is told to exit and leaves /proc/self/task when the OS next runs it, which on a
# busy 2-core CI machine can be after the call returns: wait for it (a deadline, not a timing assertion)
deadline = time.monotonic() + 1200  # tests/hang.py's bound
while threads() >= with_team and time.monotonic() < deadline:
    time.sleep(0.01)
after = threads()
torch.randn(256, 256) @ torch.randn(256, 256)
print(with_team, released, after, threads())
"""


@pytest.mark.skipif(not _gnu_openmp(), reason="needs GNU OpenMP (torch's Linux runtime) and /proc")
def test_release_caller_team_ends_the_callers_openmp_workers() -> None:
    # in a fresh process, so no other test's threads come or go between the counts
    out = subprocess.run(
        [sys.executable, "-c", _CHECK], capture_output=True, text=True, check=True, timeout=HANG_S
    ).stdout.split()
    with_team, released, after, again = int(out[0]), out[1], int(out[2]), int(out[3])
    assert released == "True"
    assert after == with_team - 1  # the caller's one team worker has exited
    assert again == with_team  # computing again on this thread builds a new team


def test_engine_loop_hands_over_before_its_worker_steps() -> None:
    seen: list[tuple[str, bool]] = []
    started: list[bool] = []

    class Recording(FakeExecutor):
        def hand_over_threads(self) -> None:
            seen.append((threading.current_thread().name, bool(started)))

    def get_requests(max_new: int) -> list[Request]:
        if not started:
            started.append(True)
            return [Request(0, [5, 6, 7], 3)]
        return []

    config = BmConfig()
    config.kv_cache.max_tokens = 256
    finished = threading.Event()
    loop = EngineLoop(
        config, get_requests, lambda r: finished.set() if r.final else None, executor=Recording()
    )
    assert finished.wait(30)
    loop.shutdown()
    # called once, on the constructing thread, before the worker fetched or ran anything
    assert seen == [(threading.current_thread().name, False)]
