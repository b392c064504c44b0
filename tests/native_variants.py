"""The instruction-set variants of bm's C kernels this machine runs (bm.cpu_isa), for tests that
check every build against torch: on an AVX-512 machine that is avx512, the forced avx2 build and the
scalar one; elsewhere what the CPU supports ("native" off x86-64)."""

from __future__ import annotations

import pytest

from bm.cpu_isa import machine_isas

ISAS = list(machine_isas())
each_isa = pytest.mark.parametrize("isa", ISAS)
