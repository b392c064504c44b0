"""The instruction-set variants of bm's C kernels this machine runs (bm.cpu_isa), for tests that
check every build against torch: on an AVX-512 machine that is avx512, the forced avx2 build and the
scalar one; elsewhere what the CPU supports ("native" off x86-64)."""

from __future__ import annotations

import pytest
import torch

from bm.cpu_isa import machine_isas

ISAS = list(machine_isas())
each_isa = pytest.mark.parametrize("isa", ISAS)


def scattered_tables(
    lengths: list[int], num_blocks: int, block_size: int, g: torch.Generator
) -> torch.Tensor:
    """Block tables for rows of ``lengths`` tokens, over blocks of the cache drawn in a random order (so
    the kernels are read through their tables, not a contiguous layout), padded with block 0."""
    assert num_blocks >= sum(-(-n // block_size) for n in lengths)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for n in lengths:
        k = -(-n // block_size)
        tables.append(perm[used : used + k])
        used += k
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables])
