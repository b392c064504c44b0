"""Which instruction set each compiled kernel is built for, chosen at load from the CPU's features.

bm's C kernels (``native/*.c``) are compiled per *variant*, each with explicit flags: ``avx512``
(AVX-512 F/BW/VL/DQ with AVX2 and FMA), ``avx2`` (AVX2 + FMA) and ``scalar`` (the x86-64 baseline: the
plain C loops, which the compiler may still vectorize with SSE2). Explicit flags rather than
``-march=native`` alone, so that an AVX-512 machine can still build and run the AVX2 variant: tests run
every variant the machine supports, and the benchmarks compare them in one sitting.

Each kernel lists the variants it has code for (``KERNEL_ISAS``); at load it gets the best of them that
the CPU supports, capped by ``BM_CPU_ISA`` (``avx512``, ``avx2``, ``scalar``; unset or ``auto``: the
best). A kernel without an AVX-512 path (LoRA) runs its AVX2 build under ``BM_CPU_ISA=avx512``. Asking
for a variant the CPU lacks is an error, not a silent fallback: figures measured under a forced variant
must be what they say. Off x86-64 there is one variant, ``native`` (``-march=native``, as before).

The choice is a pure function of a feature set (:func:`choose_isa`), so the dispatch is tested with
features faked; :func:`cpu_features` reads the real ones from ``/proc/cpuinfo``.

This module is the one owner of those rules, for the build (``bm/runtime/native_build.py`` compiles with
:func:`isa_flags`), the loader (``bm/runtime/native.py`` picks with :func:`kernel_isa`) and the early
check of ``BM_CPU_ISA`` (:func:`check_environment`, which config validation calls so that a bad value is
refused by every door, file, flags or code, before torch or a model loads). It stays outside
``bm.runtime`` and free of torch for that last use: importing anything under ``bm.runtime`` imports torch.
"""

from __future__ import annotations

import functools
import os
import platform
from collections.abc import Iterable
from pathlib import Path

ENV_ISA = "BM_CPU_ISA"
X86_MACHINES = ("x86_64", "amd64", "i686", "i386")
# Best first; "scalar" needs nothing beyond x86-64.
ISAS = ("avx512", "avx2", "scalar")
REQUIRED_FEATURES: dict[str, frozenset[str]] = {
    "avx512": frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"}),
    "avx2": frozenset({"avx2", "fma"}),
    "scalar": frozenset(),
}
# Kernel-only variants (not BM_CPU_ISA values): the avx512 build plus the bf16 dot product, and that
# plus AMX's tiles.
REQUIRED_FEATURES["avx512_bf16"] = REQUIRED_FEATURES["avx512"] | {"avx512_bf16"}
REQUIRED_FEATURES["amx_bf16"] = REQUIRED_FEATURES["avx512_bf16"] | {"amx_tile", "amx_bf16"}
# Kernel-only variants and the BM_CPU_ISA level each counts as: BM_CPU_ISA=avx2 caps them off too.
REFINES = {"avx512_bf16": "avx512", "amx_bf16": "avx512"}
_BASE = ["-march=x86-64", "-mtune=native"]
_AVX2 = ["-mavx2", "-mfma"]
ISA_FLAGS: dict[str, list[str]] = {
    "avx512": [
        *_BASE,
        *_AVX2,
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mprefer-vector-width=512",
    ],
    "avx2": [*_BASE, *_AVX2],
    "scalar": list(_BASE),
    "native": ["-march=native"],
}
ISA_FLAGS["avx512_bf16"] = [*ISA_FLAGS["avx512"], "-mavx512bf16"]
ISA_FLAGS["amx_bf16"] = [*ISA_FLAGS["avx512_bf16"], "-mamx-tile", "-mamx-bf16"]
# A build no CPU is given: bf16_gemm.c's AMX path with each tile instruction done in C, so that its
# blocking and padding are tested on CPUs without AMX (bm.runtime.native.bf16_gemm.emulated_amx_gemm).
ISA_FLAGS["amx_emulated"] = [*_BASE, "-DBM_AMX_EMULATE=1"]
# The variants each kernel has code for (its source's #if branches), best first.
KERNEL_ISAS: dict[str, tuple[str, ...]] = {
    "small_gemm": ("avx512", "avx2", "scalar"),
    "paged_decode": ("avx512", "avx2", "scalar"),
    "prefill_attention": ("avx512", "avx2", "scalar"),
    "elementwise": ("avx512", "avx2", "scalar"),
    "lora_delta": ("avx2", "scalar"),
    # bf16_gemm.c has code for AMX tiles and for AVX512_BF16 only; its scalar build reports itself
    # unavailable
    "bf16_gemm": ("amx_bf16", "avx512_bf16", "scalar"),
    # int8_gemm.c: AVX-512 and AVX2 paths, the same chains as the plain C loops
    "int8_gemm": ("avx512", "avx2", "scalar"),
    # group_gemm.c (GGUF blocks): the same layout of paths as int8_gemm.c
    "group_gemm": ("avx512", "avx2", "scalar"),
}

# The variants whose attention kernels (paged_decode.c, prefill_attention.c) also read a bf16 KV cache:
# their bm_*_bf16 entry points exist in these builds only (docs/cpu-kernels.md, "bfloat16 on the CPU").
BF16_KV_ISAS = frozenset({"avx512"})
_ATTENTION_KERNELS = ("paged_decode", "prefill_attention")


def is_x86(machine: str) -> bool:
    return machine.lower() in X86_MACHINES


@functools.cache
def cpu_features() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (``flags`` in /proc/cpuinfo); empty elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


# Flags that give a CPU bfloat16 arithmetic of its own: x86's AVX512_BF16 dot products and AMX tiles,
# Arm's BF16 (ARMv8.6). Without them torch and oneDNN emulate bf16 through float32, several times slower.
BF16_FEATURES = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def native_bf16(features: Iterable[str]) -> bool | None:
    """Whether a CPU with ``features`` computes in bfloat16 natively; None when its features are unknown
    (no ``/proc/cpuinfo``), where bm then takes the dtype asked for as it is."""
    have = frozenset(features)
    if not have:
        return None
    return bool(have & BF16_FEATURES)


def supported_isas(features: Iterable[str], machine: str) -> tuple[str, ...]:
    """The variants a CPU with ``features`` can run, best first."""
    if not is_x86(machine):
        return ("native",)
    have = frozenset(features)
    return tuple(isa for isa in ISAS if REQUIRED_FEATURES[isa] <= have)


def requested_isa(value: str | None) -> str | None:
    """``BM_CPU_ISA``'s value checked: None for unset/auto, else one of :data:`ISAS`."""
    if value is None or value.strip().lower() in ("", "auto"):
        return None
    isa = value.strip().lower()
    if isa not in ISAS:
        raise ValueError(
            f"{ENV_ISA}={value!r} is not an instruction set bm builds for; use one of auto, {', '.join(ISAS)}"
        )
    return isa


def choose_isa(kernel: str, features: Iterable[str], machine: str, requested: str | None = None) -> str:
    """The variant ``kernel`` is built for: the best it has code for that the CPU runs, no better than
    ``requested`` (a value of ``BM_CPU_ISA``). Raises ValueError where ``requested`` cannot run here."""
    cap = requested_isa(requested)
    runnable = supported_isas(features, machine)
    if runnable == ("native",):
        if cap is not None:
            raise ValueError(f"{ENV_ISA}={cap} is an x86-64 setting; this CPU is {machine}: unset it")
        return "native"
    if cap is not None and cap not in runnable:
        missing = sorted(REQUIRED_FEATURES[cap] - frozenset(features))
        raise ValueError(
            f"{ENV_ISA}={cap}, but this CPU lacks {', '.join(missing)}; use one of {', '.join(runnable)}"
        )
    allowed = ISAS[ISAS.index(cap) :] if cap is not None else ISAS
    have = frozenset(features)
    for isa in KERNEL_ISAS[kernel]:
        if REFINES.get(isa, isa) in allowed and REQUIRED_FEATURES[isa] <= have:
            return isa
    return "scalar"


def bf16_kv_cache(features: Iterable[str], machine: str, requested: str | None = None) -> bool:
    """Whether a bf16 model's KV cache stays bf16 on a CPU with ``features``: where both attention
    kernels load a build that reads bf16 keys and values (:data:`BF16_KV_ISAS`), else it is float32 (each
    bf16 value held exactly) so that the float32 kernels read it. Raises as :func:`choose_isa` does."""
    return all(choose_isa(k, features, machine, requested) in BF16_KV_ISAS for k in _ATTENTION_KERNELS)


# model.cpu_bf16_gemm (bm.config.model): how auto resolves on a CPU with AVX512_BF16 and no AMX, as
# measured (docs/cpu-kernels.md, "Batch-invariant bf16"); AMX CPUs keep oneDNN, whose AMX tiles this
# kernel's vdpbf16ps cannot match.
AUTO_BF16_GEMM_WITHOUT_AMX = "invariant"
AMX_BF16 = "amx_bf16"
# The builds of bf16_gemm.c with code: AMX tiles, and AVX512_BF16's vdpbf16ps.
BF16_GEMM_BUILDS = ("amx_bf16", "avx512_bf16")


def cpu_bf16_gemm(
    requested: str,
    features: Iterable[str],
    machine: str,
    isa_request: str | None = None,
    prepack: str = "auto",
) -> str:
    """The GEMM bf16 CPU linears run on for ``model.cpu_bf16_gemm`` = ``requested`` (auto, onednn,
    invariant): ``onednn`` or ``invariant`` (bm's ``bf16_gemm.c``: its AMX build where the CPU has AMX
    tiles, its AVX512_BF16 build elsewhere; both need AVX512_BF16).

    The one place the choice is made and refused, torch-free so that config validation refuses an
    impossible ``invariant`` before a model loads (ValueError naming the key and the fix). ``auto`` keeps
    oneDNN on AMX CPUs (measured faster than the vdpbf16ps build there; bm's AMX build is not measured
    yet, so it runs only when asked for) and where the kernel has no build; elsewhere it takes
    :data:`AUTO_BF16_GEMM_WITHOUT_AMX`. ``isa_request`` is ``BM_CPU_ISA``'s
    value: a cap below avx512 leaves the kernel no build. ``prepack`` (model.prepack): off leaves the
    weights unpacked, and the kernel reads only its own packed copy."""
    if requested == "onednn":
        return "onednn"
    if prepack == "off":
        if requested == "invariant":
            raise ValueError(
                "model.cpu_bf16_gemm: invariant runs on weights packed for bm's kernel, which model.prepack "
                "off leaves unpacked: set model.prepack to auto or on"
            )
        return "onednn"
    have = frozenset(features)
    runs = is_x86(machine) and choose_isa("bf16_gemm", have, machine, isa_request) in BF16_GEMM_BUILDS
    if requested == "invariant":
        if not runs:
            raise ValueError(_no_invariant_gemm(have, machine, isa_request))
        return "invariant"
    if AMX_BF16 in have or not runs:
        return "onednn"
    return AUTO_BF16_GEMM_WITHOUT_AMX


def _no_invariant_gemm(have: frozenset[str], machine: str, isa_request: str | None) -> str:
    """Why ``model.cpu_bf16_gemm: invariant`` cannot run here, and what to set instead."""
    fix = (
        "set model.cpu_bf16_gemm to auto or onednn (bf16 that is not batch-invariant), or model.dtype to "
        "float32 (batch-invariant on every CPU)"
    )
    if not is_x86(machine):
        return f"model.cpu_bf16_gemm: invariant needs an x86-64 CPU with AVX512_BF16; this one is {machine}: {fix}"
    missing = sorted(REQUIRED_FEATURES["avx512_bf16"] - have)
    if missing:
        return f"model.cpu_bf16_gemm: invariant needs AVX512_BF16; this CPU lacks {', '.join(missing)}: {fix}"
    return (
        f"model.cpu_bf16_gemm: invariant needs the AVX-512 build, which {ENV_ISA}={isa_request} rules out: "
        f"unset {ENV_ISA}, or {fix}"
    )


def machine_isas() -> tuple[str, ...]:
    """The variants this machine runs, best first."""
    return supported_isas(cpu_features(), platform.machine())


def kernel_isa(kernel: str, requested: str | None = None) -> str:
    """The variant ``kernel`` loads with on this machine: ``requested`` if given, else ``BM_CPU_ISA``
    (checked once when a config is validated: bm.config.validate)."""
    if requested is None:
        requested = os.environ.get(ENV_ISA)
    return choose_isa(kernel, cpu_features(), platform.machine(), requested)


def isa_flags(isa: str) -> list[str]:
    """The compiler flags that select ``isa``'s code in the kernels' sources."""
    return list(ISA_FLAGS[isa])


def check_environment() -> None:
    """Refuse a ``BM_CPU_ISA`` that names no variant or one this CPU cannot run (ValueError), so that a
    run stops before loading anything rather than at its first kernel."""
    kernel_isa("small_gemm")
