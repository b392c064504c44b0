"""bm's batch-invariant bf16 GEMM (``native/bf16_gemm.c``): within bf16 rounding of the float32 product,
and each row's bits the same whatever else shares the call.

What is pinned against the reference: with ``exact`` the product of the bf16 inputs summed in float64
(plus the bias), every output is within ``2**-8 * (|exact| + e) + e`` of it, where ``e = (K + 2) * 2**-24
* (|x| @ |w|.T + |bias|)`` bounds a float32 chain of K products and the bias add: one bf16 rounding (half
an ulp, 2**-8 relative) of a float32 sum. And at least 99% of the outputs are bitwise those of
``(x.float() @ w.float().T + bias.float()).bfloat16()``: the two float32 sums differ only in order, which
moves a rounding only where it sits near a tie."""

from __future__ import annotations

import pytest
import torch

from bm.cpu_isa import BF16_GEMM_BUILDS
from bm.runtime.native import Bf16GemmKernel, bf16_gemm_kernel

pytestmark = pytest.mark.skipif(
    bf16_gemm_kernel() is None, reason="bm's bf16 GEMM needs AVX512_BF16 and a C compiler"
)

# (N, K): one column, tails of 1 and 15 columns (alone and after a full panel or pair), odd K of 1, 7 and
# 577, K = 2 (one pair), and SmolLM2's projections
SHAPES = [(1, 1), (17, 2), (33, 7), (47, 64), (100, 577), (576, 576), (1536, 576), (576, 1536)]
ROWS = [1, 2, 11, 12, 13, 25, 70]


def kernel() -> Bf16GemmKernel:
    k = bf16_gemm_kernel()
    assert k is not None and k.isa in BF16_GEMM_BUILDS
    return k


def inputs(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 x [m, k] with strided rows (row stride k + 3: odd, so pairs straddle 4-byte boundaries), a
    weight [n, k] and a bias [n]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k + 3, generator=g).bfloat16()[:, 1 : k + 1]
    return x, torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_the_bf16_gemm_is_one_bf16_rounding_from_the_float32_product(n, k, with_bias):
    gemm = kernel()
    for m in ROWS:
        x, w, b = inputs(m, n, k, seed=m * 1000 + n + k)
        bias = b if with_bias else None
        got = gemm(x, Bf16GemmKernel.pack(w), bias, n)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        extra = b.double() if with_bias else torch.zeros(n, dtype=torch.float64)
        exact = x.double() @ w.double().T + extra
        e = (k + 2) * 2.0**-24 * (x.double().abs() @ w.double().abs().T + extra.abs())
        bound = 2.0**-8 * (exact.abs() + e) + e
        assert ((got.double() - exact).abs() <= bound).all(), f"{m} rows"
        torch_bits = (x.float() @ w.float().T + (b.float() if with_bias else 0)).bfloat16()
        assert (got == torch_bits).double().mean() >= 0.99, f"{m} rows"


def test_a_3d_input_keeps_its_leading_dimensions():
    x, w, b = inputs(6, 40, 9, seed=1)
    got = kernel()(x.reshape(2, 3, 9), Bf16GemmKernel.pack(w), b, 40)
    assert got.shape == (2, 3, 40)
    assert torch.equal(got.reshape(6, 40), kernel()(x, Bf16GemmKernel.pack(w), b, 40))


@pytest.mark.parametrize(("n", "k"), [(576, 576), (1536, 576), (576, 1536), (200, 2048)])
@pytest.mark.parametrize("team", [1, 3])
def test_each_row_of_a_batch_has_the_bits_it_gets_alone(threads, n, k, team):
    """At SmolLM2's widths and K = 2,048, up to 300 rows: across 12-row tiles and their shorter
    remainders, the one-block limit (128 rows) and the row blocks above it (60 rows at K = 2,048), and
    threads owning runs of panel pairs of unequal length (3 threads)."""
    threads(team)
    gemm = kernel()
    x, w, b = inputs(300, n, k, seed=n + k)
    packed = Bf16GemmKernel.pack(w)
    alone = torch.cat([gemm(x[i : i + 1], packed, b, n) for i in range(x.shape[0])])
    for m in (2, 11, 13, 64, 129, 300):
        assert torch.equal(gemm(x[:m], packed, b, n), alone[:m]), f"{m} rows"
    for start, stop in ((5, 17), (120, 250), (299, 300)):
        assert torch.equal(gemm(x[start:stop], packed, b, n), alone[start:stop]), (start, stop)


def test_the_thread_count_does_not_change_a_bit(threads):
    x, w, b = inputs(70, 200, 576, seed=3)
    packed = Bf16GemmKernel.pack(w)
    threads(1)
    one = kernel()(x, packed, b, 200)
    threads(4)
    assert torch.equal(kernel()(x, packed, b, 200), one)


def test_wrong_inputs_are_refused_before_the_call():
    x, w, _ = inputs(2, 32, 8, seed=0)
    packed = Bf16GemmKernel.pack(w)
    with pytest.raises(ValueError, match="bfloat16"):
        kernel()(x.float(), packed, None, 32)
    with pytest.raises(ValueError, match="against packed"):
        kernel()(x[:, :6], packed, None, 32)
    with pytest.raises(ValueError, match="do not fit"):
        kernel()(x, packed, None, 48)
