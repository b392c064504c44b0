"""Handing the CPU's compute threads from the thread that loaded a model to the engine's worker thread.

torch runs its CPU ops, and bm's C kernels, on OpenMP teams. With GNU OpenMP (the runtime in torch's
Linux wheels) every thread that starts a parallel region keeps a team of its own. A model is loaded on the
caller's thread, which creates that thread's team; the engine then computes on its worker thread, which
creates a second team. Once the runtime manages more threads than the machine has CPUs, it stops letting
idle team members spin and puts them to sleep after a few iterations instead, so every parallel region
pays a futex wake-up. On a 2-core machine that doubled the time of a small decode forward (5 ms on the
loading thread, 10 ms on a worker thread, the bench model) and made ``bm bench``, ``bm run`` and the
real-engine side of ``bm sweep`` slower than the same forwards timed anywhere else.

:func:`release_caller_team` gives the calling thread's team back (``omp_pause_resource_all``, OpenMP 5.0,
which libgomp implements by freeing only the caller's pool), so the worker's team is the only one. It
runs on the thread that is about to stop computing; if that thread computes again later it simply gets a
new team.
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bm.cpu_load import CpuTicks, background_share, read_ticks
from bm.runtime.native.build import loaded_openmp_runtime

_OMP_PAUSE_SOFT = 1
_lock = threading.Lock()
_runtime: list[Any] = []  # [ctypes library or None], filled once


def _gomp() -> Any:
    """The loaded GNU OpenMP library, or None (another runtime, or none found)."""
    with _lock:
        if not _runtime:
            path = loaded_openmp_runtime()
            lib = None
            # only libgomp: Intel's runtime pauses every thread of the process, not the caller's team
            if path is not None and path.name.startswith("libgomp"):
                try:
                    lib = ctypes.CDLL(str(path))
                    lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
                    lib.omp_pause_resource_all.restype = ctypes.c_int
                    lib.omp_in_parallel.restype = ctypes.c_int
                except (OSError, AttributeError):
                    lib = None
            _runtime.append(lib)
        return _runtime[0]


def release_caller_team() -> bool:
    """Free the calling thread's OpenMP team; True when there was a runtime to ask and it agreed.

    Call it on a thread that has finished computing and hands its work to another thread (the engine's
    worker). Harmless anywhere outside a parallel region: a later op on this thread builds a new team."""
    lib = _gomp()
    if lib is None or lib.omp_in_parallel():
        return False
    return bool(lib.omp_pause_resource_all(_OMP_PAUSE_SOFT) == 0)


@dataclass(frozen=True)
class LoadReading:
    """Where a governor left off: the thread count it computed with and its last reading of the load (its
    clock's time and the tick counts). The next governor of the same executor starts from it, so an
    engine's first step already runs on the count the load called for (see :meth:`ThreadGovernor.settle`)."""

    count: int
    at: float
    ticks: CpuTicks | None


class ThreadGovernor:
    """The CPU engine's thread count, given back while other processes hold cores.

    An OpenMP parallel region ends when its slowest thread does. When another process takes a core, one
    of bm's threads waits for its share of that core, and its teammate spins at the region's barrier
    meanwhile: on 2 cores, one busy process beside ``bm bench`` cut the embedded model from about 22,000
    to 200-1,300 output tok/s, where one thread alone kept 2,900-3,800 (GNU OpenMP's passive waiting kept
    2,400-6,800 but halved the quiet machine's speed). So every ``window_s`` seconds (a tenth: threads come back soon after the load goes) the engine reads
    how many cores' worth other processes used (bm.cpu_load) and computes on the cores left, at least one
    and at most the threads it was given; they come back once the others stop. Results do not change:
    bm's kernels and the forward give the same bits at any thread count (tests pin it).
    """

    def __init__(
        self,
        threads: int,
        cpus: int,
        *,
        window_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
        read: Callable[[], CpuTicks | None] = read_ticks,
        set_threads: Callable[[int], None] | None = None,
        resume: LoadReading | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """``resume``: an earlier governor's :meth:`reading` (the previous engine's, or the warm-up's): this
        one computes with its count at once, and its first window starts at that reading."""
        self.threads = threads  # what the engine was given (torch's count when it started)
        self.current = threads
        self.cpus = cpus
        self.window_s = window_s
        self._clock = clock
        self._read = read
        self._set = set_threads or _set_torch_threads
        self._sleep = sleep
        self.changes = 0  # how often the count moved (reported, and pinned by tests)
        if resume is None:
            self._since, self._last = clock(), read()
            return
        self._since, self._last = resume.at, resume.ticks
        count = max(1, min(threads, resume.count))
        if count != self.current:
            self._set(count)
            self.current = count

    def tick(self) -> int:
        """Call on the computing thread before each step; returns the thread count to compute with."""
        now = self._clock()
        if now - self._since < self.window_s:
            return self.current
        ticks = self._read()
        share = background_share(self._last, ticks)
        self._since, self._last = now, ticks
        if share is None:
            return self.current
        others = share * self.cpus  # cores' worth
        wanted = max(1, min(self.threads, math.floor(self.cpus - others + 0.5)))
        if wanted != self.current:
            self._set(wanted)
            self.current = wanted
            self.changes += 1
        return self.current

    def settle(self) -> int:
        """Wait out the rest of the first window, then :meth:`tick`: the count the load calls for, decided
        before anything is timed. A governor made with nothing to resume computes with every thread
        until its first window ends, which on a 2-core machine beside a busy process made the first step
        of every run 5-10x slower than the next (spinning teammates at each barrier); an engine settles
        once, at build, and every later governor of it resumes from there."""
        left = self.window_s - (self._clock() - self._since)
        if left > 0:
            self._sleep(left)
        return self.tick()

    def reading(self) -> LoadReading:
        """Where this governor is: handed to the next one (:class:`LoadReading`)."""
        return LoadReading(self.current, self._since, self._last)

    def restore(self) -> None:
        """Give the engine's thread count back (the engine is done)."""
        if self.current != self.threads:
            self._set(self.threads)
            self.current = self.threads


def _set_torch_threads(count: int) -> None:
    import torch

    torch.set_num_threads(count)


def governor_for(setting: str, device_type: str, resume: LoadReading | None = None) -> ThreadGovernor | None:
    """``model.yield_cores``: auto and on govern a CPU engine of more than one thread; off (or a GPU, or
    a machine whose load cannot be read) leaves the count alone. Call it on the computing thread (the
    count is that thread's); ``resume``: see :class:`ThreadGovernor`."""
    import torch

    threads = torch.get_num_threads()
    if setting == "off" or device_type != "cpu" or threads < 2 or read_ticks() is None:
        return None
    return ThreadGovernor(threads, os.cpu_count() or threads, resume=resume)
