"""The batch-invariant bf16 GEMM's AMX build (``bf16_amx.h``): chosen on AMX CPUs by their features,
compiled for AMX where the compiler can, and its path (blocking, padding, epilogue) run with each tile
instruction done in C on any CPU, where it must give exactly the sequential float32 sum over k in order
that its tile instructions define."""

from __future__ import annotations

import ctypes

import pytest
import torch

from bm.cpu_isa import REQUIRED_FEATURES, choose_isa, cpu_bf16_gemm, cpu_features
from bm.runtime.native.bf16_gemm import Bf16GemmKernel, emulated_amx_gemm
from bm.runtime.native.build import compile_kernel
from bm.runtime.native.loader import SOURCES

AVX512_BF16 = REQUIRED_FEATURES["avx512_bf16"]
AMX = AVX512_BF16 | {"amx_tile", "amx_bf16"}


def _emulated() -> Bf16GemmKernel:
    kernel = emulated_amx_gemm()
    if kernel is None:
        pytest.skip("bm's C kernels do not build here")
    return kernel


def sequential(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Each output as the AMX path defines it: a float32 sum of the exact bf16 products over k, one
    rounding per step, k in order; then + bias, rounded to bf16."""
    xf, wf = x.float(), w.float()
    acc = torch.zeros(x.shape[0], w.shape[0])
    for k in range(x.shape[1]):
        acc = acc + xf[:, k : k + 1] * wf[:, k]  # a product of two bf16 values is exact in float32
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(torch.bfloat16)


def test_amx_cpus_get_the_amx_build_and_a_cap_below_avx512_none():
    assert choose_isa("bf16_gemm", AMX, "x86_64") == "amx_bf16"
    assert choose_isa("bf16_gemm", AMX, "x86_64", "avx512") == "amx_bf16"
    assert choose_isa("bf16_gemm", AMX, "x86_64", "avx2") == "scalar"
    assert choose_isa("bf16_gemm", AVX512_BF16, "x86_64") == "avx512_bf16"


def test_invariant_runs_on_amx_when_asked_and_auto_keeps_onednn_there_until_measured():
    assert cpu_bf16_gemm("invariant", AMX, "x86_64") == "invariant"
    assert cpu_bf16_gemm("auto", AMX, "x86_64") == "onednn"
    assert cpu_bf16_gemm("auto", AVX512_BF16, "x86_64") == "invariant"


@pytest.mark.parametrize(
    ("m", "n", "k"), [(1, 16, 32), (15, 35, 77), (16, 50, 64), (17, 33, 31), (40, 20, 100)]
)
def test_the_amx_path_is_the_sequential_float32_sum_over_k_row_by_row(m, n, k):
    """One and two row blocks, a part block; one panel, a pair and part panels; k a whole tile step, an
    odd k, a k past one step: the zero padding changes no sum, and each row's bits are those it gets
    alone."""
    g = torch.Generator().manual_seed(m * n + k)
    kernel = _emulated()
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    packed = kernel.pack(w)
    for b in (bias, None):
        y = kernel(x, packed, b, n)
        assert torch.equal(y, sequential(x, w, b))
        for i in range(m):
            assert torch.equal(kernel(x[i : i + 1], packed, b, n), y[i : i + 1]), f"row {i}"


def test_the_amx_build_compiles_and_runs_only_where_the_cpu_has_amx():
    """Built with the compiler's AMX flags on any x86-64 machine; where the CPU lacks AMX it reports
    itself unavailable (the OS refuses the tile state), so bm keeps its other build or oneDNN. Its
    availability check is called only on AVX-512 CPUs, since the build may use AVX-512 anywhere."""
    lib = compile_kernel(SOURCES / "bf16_gemm.c", "amx_bf16")
    if lib is None:
        pytest.skip("the compiler here cannot build for AMX")
    assert isinstance(lib.bm_bf16_gemm, ctypes._CFuncPtr)
    have = cpu_features()
    if have >= AVX512_BF16:
        assert lib.bm_bf16_gemm_available() == int({"amx_tile", "amx_bf16"} <= have)
