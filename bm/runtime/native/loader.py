"""Loading a compiled kernel: built for the variant the CPU runs, once per process, or None.

Each kernel's wrapper module names its C source (``<name>.c`` beside it) and the class that wraps the
library; :func:`load_kernel` builds it for the instruction set :func:`bm.cpu_isa.kernel_isa` picks
(:mod:`bm.runtime.native.build` caches the build per machine) and keeps the wrapper for the process.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bm.cpu_isa import kernel_isa
from bm.runtime.native.build import compile_kernel

ENV_SWITCH = "BM_NATIVE_KERNELS"
SOURCES = Path(__file__).parent  # the kernels' C sources and headers

_lock = threading.Lock()
_loaded: dict[tuple[str, str], object] = {}


class NativeKernel:
    """A compiled kernel's wrapper; ``isa`` names the variant it was built for (bm.cpu_isa)."""

    isa: str = ""


def native_kernels_enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def load_kernel(name: str, wrap: Callable[[ctypes.CDLL], NativeKernel | None], isa: str | None) -> Any:
    """``wrap`` of the compiled ``<name>.c`` for the variant :func:`bm.cpu_isa.kernel_isa` picks (``isa``
    caps it, else ``BM_CPU_ISA``), or None where kernels are switched off or it cannot be built; decided
    once per process and variant."""
    if not native_kernels_enabled() or sys.platform == "win32":
        return None
    return load_variant(name, wrap, kernel_isa(name, isa))


def load_variant(name: str, wrap: Callable[[ctypes.CDLL], NativeKernel | None], variant: str) -> Any:
    """``wrap`` of ``<name>.c`` built for exactly ``variant`` (bm.cpu_isa.ISA_FLAGS' key), or None as
    :func:`load_kernel`; for a kernel's fallback to its next build, and for builds no CPU is given."""
    if not native_kernels_enabled() or sys.platform == "win32":
        return None
    with _lock:
        if (name, variant) not in _loaded:
            lib = compile_kernel(SOURCES / f"{name}.c", variant)
            kernel = wrap(lib) if lib is not None else None
            if kernel is not None:
                kernel.isa = variant
            _loaded[name, variant] = kernel
        return _loaded[name, variant]
