"""The instruction-set variants of bm's C kernels this machine runs (bm.cpu_isa), for tests that
check every build against torch: on an AVX-512 machine that is avx512, the forced avx2 build and the
scalar one; elsewhere what the CPU supports ("native" off x86-64)."""

from __future__ import annotations

import pytest
import torch

from bm.cpu_isa import machine_isas

ISAS = list(machine_isas())
each_isa = pytest.mark.parametrize("isa", ISAS)

# Decode kernel shapes that reach every code path of paged_decode.c, for the tests that hold a cache
# dtype's kernel to the float32 one: head sizes 64/128/16 take the sixteen-lane bodies, 40 the eight-lane
# dot product and the scalar V loop, 12 the scalar code only; block sizes 1 and 5 leave keys over after
# the eight-key groups.
each_decode_shape = pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (8, 2, 128, 32), (6, 3, 12, 4), (8, 1, 40, 16), (4, 4, 64, 1), (7, 7, 16, 5)],
)
# A layer's extras (soft-capping, ALiBi, a window, sink logits), alone and together.
each_decode_extra = pytest.mark.parametrize(
    ("softcap", "alibi", "window", "sink"),
    [(2.0, False, None, False), (None, True, None, False), (None, False, 5, False), (0.5, True, 9, True)],
)


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
