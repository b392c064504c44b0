"""Host memory for a long-running inference process: large activation buffers kept in the heap, and
the KV cache's pool reserved without being charged against the machine's memory.

Keeping activation buffers in the heap (:func:`tune_host_allocator`):

With glibc's defaults a freed multi-megabyte tensor goes back to the kernel (mmap/munmap or heap
trimming), and the next forward's tensor of the same size page-faults its memory back in, zeroed by
the kernel: 20,000-65,000 minor faults and 70-190 ms of system time per 2,048-token forward of the
15M-parameter benchmark model, measured here. Raising the mmap and trim thresholds makes glibc reuse
that memory instead. The setting is process-wide and only ever helps a long-running inference process;
it is skipped where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap
import sys

import torch

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling for this setting on 64-bit
_TRIM_THRESHOLD = 1 << 30

_tuned: bool | None = None


def tune_host_allocator() -> bool:
    """Apply the thresholds once; returns whether the C library accepted them."""
    global _tuned
    if _tuned is not None:
        return _tuned
    _tuned = False
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    _tuned = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
    )
    return _tuned


# Linux's MAP_NORESERVE (the same value on x86-64 and arm64); Python's mmap module does not export it.
_MAP_NORESERVE = 0x4000


def reserved_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros whose pages the OS maps at their first write, and which is not counted
    against the machine's memory until then.

    The CPU KV pool is sized for the most a run could hold (14 GB by default) and touched only as far
    as a run's peak use. Allocated by ``torch.empty`` it is an ordinary private mapping, which Linux
    charges in full at every ``fork()``: with the kernel's default (heuristic) overcommit, a process
    holding two such pools on a 24 GB machine could no longer fork (``OSError: [Errno 12] Cannot
    allocate memory``), a ``multiprocessing`` pool or a ``DataLoader`` worker included. A
    ``MAP_NORESERVE`` mapping is charged page by page as it is written, like any touched memory, and
    anonymous pages start as zeros, so the pool needs no fill. Elsewhere than Linux: ``torch.zeros``."""
    count = math.prod(shape)
    if not sys.platform.startswith("linux") or count == 0:
        return torch.zeros(shape, dtype=dtype)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
    return torch.frombuffer(buffer, dtype=dtype).view(shape)  # the tensor keeps the mapping alive
