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
import threading
from typing import Any

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
