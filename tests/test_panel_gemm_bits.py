"""The AVX-512 panel GEMM's blocking (tiles of up to 12 rows, row blocks of up to 256 KiB of x above 128
rows, a run of panel pairs per thread, the next pair's weight prefetched, outputs over 4 MiB streamed)
never changes a bit: every output stays one FMA chain over k in order, as in the AVX2 build, whose tiles
(6 rows x 16 columns, row blocks of 96) cut the work differently. The row counts cross each boundary: the
12-row tile (11, 12, 13), the AVX2 build's 96-row block (95, 96, 97), the one-block limit (128, 129),
and at K = 1536 the 256 KiB row block, 36 rows (168, 337, 2048); 528 columns at 2,048 rows stream."""

from __future__ import annotations

import pytest
import torch

from bm.runtime.native import SmallGemmKernel, small_gemm_kernel
from tests.native_variants import ISAS

K = 1536  # 256 KiB of x holds 42 rows of 1536 floats: the AVX-512 driver's row blocks are 36 rows
ROWS = (1, 11, 12, 13, 95, 96, 97, 128, 129, 168, 337, 2048)
# 48: a pair and a lone full panel; 200: 12 full panels and an 8-column tail alone; 216: a full panel
# with the tail in the last work item; 528: 33 full panels, whose 2,048-row output (4.3 MB) is streamed
WIDTHS = (48, 200, 216, 528)


@pytest.fixture(scope="module")
def kernels() -> tuple[SmallGemmKernel, SmallGemmKernel]:
    if not {"avx512", "avx2"} <= set(ISAS):
        pytest.skip("needs a CPU with AVX-512 (the AVX2 build is the reference)")
    wide, narrow = small_gemm_kernel("avx512"), small_gemm_kernel("avx2")
    if wide is None or narrow is None:
        pytest.skip("the panel GEMM needs a C compiler")
    return wide, narrow


@pytest.mark.parametrize("n", WIDTHS)
@pytest.mark.parametrize("team", [1, 3])
def test_avx512_blocking_gives_the_avx2_builds_bits_at_every_boundary(kernels, threads, n, team):
    wide, narrow = kernels
    threads(team)  # 3 threads: runs of pairs of unequal length
    torch.manual_seed(n)
    weight, bias = torch.randn(n, K), torch.randn(n)
    packed = SmallGemmKernel.pack(weight)
    x = torch.randn(max(ROWS), K + 5)[:, 2 : K + 2]  # strided rows
    for rows in ROWS:
        for b in (bias, None):
            got = wide(x[:rows], packed, b, n)
            assert torch.equal(got, narrow(x[:rows], packed, b, n)), f"{rows} rows, bias {b is not None}"


@pytest.mark.parametrize("n", [216, 528])
def test_avx512_rows_alone_equal_the_same_rows_in_a_2048_row_batch(kernels, n):
    """Batch invariance across tiles, row blocks and the prefetching first block; at 528 columns the
    batch's output is streamed and the few rows' is not."""
    wide, _ = kernels
    torch.manual_seed(7)
    weight = torch.randn(n, K)
    packed = SmallGemmKernel.pack(weight)
    x = torch.randn(2048, K)
    batch = wide(x, packed, None, n)
    for start, stop in ((0, 1), (11, 13), (167, 170), (95, 97), (2040, 2048), (400, 413), (100, 229)):
        assert torch.equal(wide(x[start:stop], packed, None, n), batch[start:stop]), (start, stop)
