"""Compiling bm's C kernels (``native/*.c``) at first use, one build per instruction-set variant.

bm ships no binaries and needs no build step at install: the first engine on a machine compiles each
kernel it loads (about a second with gcc) into bm's cache directory (``$BM_CACHE_DIR``, else
``~/.cache/bm``: ``kernels/``), under a name that carries the variant (``avx512``, ``avx2``, ``scalar``:
bm.cpu_isa) and hashes the source, the flags, the variant, the compiler, the OpenMP runtime it
links and the CPU (``-mtune=native``), so every later run on that machine only loads it. A cache that
cannot be written falls back to compiling into a temporary directory for this process.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from bm.cpu_isa import isa_flags

log = logging.getLogger(__name__)

_FLAGS = [
    "-O3",
    # Let the compiler vectorize the scalar fallback's reductions; no -ffast-math, whose start-up code
    # would flush denormals for the whole process (torch included).
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fno-signed-zeros",
    "-fassociative-math",
    "-fPIC",
    "-pthread",
]


def _flags(isa: str) -> list[str]:
    """Every flag a build of variant ``isa`` is compiled with."""
    return [*_FLAGS, *isa_flags(isa)]


def loaded_openmp_runtime() -> Path | None:
    """The OpenMP library torch runs its ops on, as mapped into this process (Linux)."""
    torch.ones(2).sum()  # make sure torch has started its runtime
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split()[-1] if line.split() else ""
        name = Path(path).name
        if name.startswith(("libgomp", "libiomp5")) and ".so" in name and Path(path).is_file():
            return Path(path)
    return None


def _run_compiler(cmd: list[str]) -> str | None:
    """None on success, else why not."""
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as exc:
        return getattr(exc, "stderr", "") or str(exc)
    return None


@functools.cache
def _cpu_identity() -> str:
    """What ``-mtune=native`` / ``-march=native`` compile for: the CPU model and its feature flags (Linux),
    else the arch."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    wanted = [line for line in lines if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(wanted)) or os.uname().machine


@functools.cache
def _compiler_version(compiler: str) -> str:
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout


def _cache_key(source: Path, compiler: str, omp: Path | None, isa: str) -> str:
    parts = [
        source.read_text(),
        # the headers the sources include (a changed header must rebuild every kernel)
        *(header.read_text() for header in sorted(source.parent.glob("*.h"))),
        " ".join(_flags(isa)),
        isa,
        compiler,
        _compiler_version(compiler),
        str(omp),
        _cpu_identity(),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def kernel_cache_dir() -> Path:
    from bm.runtime.presets import cache_root

    return cache_root() / "kernels"


def compile_kernel(source: Path, isa: str) -> ctypes.CDLL | None:
    """Load the machine's cached build of ``source`` for instruction set ``isa``, building it first when
    there is none; None (logged) where it cannot be built."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        log.info("no C compiler found: %s runs on torch ops", source.stem)
        return None
    omp = loaded_openmp_runtime()
    cached = kernel_cache_dir() / f"{source.stem}-{isa}-{_cache_key(source, compiler, omp, isa)}.so"
    if cached.is_file():
        try:
            return ctypes.CDLL(str(cached))
        except OSError as exc:  # a damaged file: build it again below
            log.info("the cached %s could not be loaded (%s); building it again", cached, exc)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="bm-native-", dir=cached.parent) as tmp:
            built = _build(source, compiler, omp, Path(tmp), isa)
            if built is None:
                return None
            os.replace(built, cached)  # atomic: a concurrent run sees the whole file or none
        return ctypes.CDLL(str(cached))
    except OSError as exc:  # an unwritable cache, or one mounted noexec: this process only
        log.info("kernel cache %s unusable (%s); compiling for this process only", cached.parent, exc)
    with tempfile.TemporaryDirectory(prefix="bm-native-") as tmp:
        built = _build(source, compiler, omp, Path(tmp), isa)
        if built is None:
            return None
        try:
            # dlopen maps the file; it may be deleted with the directory once loaded.
            return ctypes.CDLL(str(built))
        except OSError as exc:  # e.g. a temporary directory mounted noexec
            log.info("loading the compiled %s failed, it runs on torch ops: %s", source.name, exc)
            return None


def _build(source: Path, compiler: str, omp: Path | None, tmp: Path, isa: str) -> Path | None:
    """Compile ``source`` into a shared library in ``tmp``; None (logged) when it cannot be."""
    lib_path = tmp / f"{source.stem}.so"
    error = "no OpenMP runtime found in this process"
    if omp is not None:
        # Threads from torch's own OpenMP pool: compile with OpenMP, link against the very library
        # torch loaded (not the compiler's), so one runtime serves both.
        obj = tmp / f"{source.stem}.o"
        error = _run_compiler(
            [compiler, *_flags(isa), "-fopenmp", "-DBM_OPENMP", "-c", str(source), "-o", str(obj)]
        )
        if error is None:
            link = [compiler, "-shared", "-pthread", str(obj), str(omp), f"-Wl,-rpath,{omp.parent}"]
            error = _run_compiler([*link, "-o", str(lib_path), "-lm"])
    if error is not None:
        log.info("OpenMP build of %s failed (%s); using its own threads", source.name, error.strip())
        error = _run_compiler([compiler, *_flags(isa), "-shared", str(source), "-o", str(lib_path), "-lm"])
    if error is not None:
        log.info("compiling %s failed, it runs on torch ops: %s", source.name, error)
        return None
    return lib_path
