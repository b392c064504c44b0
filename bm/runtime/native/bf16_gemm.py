"""The batch-invariant bfloat16 panel GEMM (``bf16_gemm.c``): bm's bf16 CPU linears under
``model.cpu_bf16_gemm: invariant``."""

from __future__ import annotations

import ctypes

import torch

from bm.cpu_isa import BF16_GEMM_BUILDS, kernel_isa
from bm.runtime.native.args import BF16, INT, PTR, as_rows, bind, pointer, require
from bm.runtime.native.loader import NativeKernel, load_kernel, load_variant

PANEL = 16  # output columns per packed weight panel in bf16_gemm.c


class Bf16GemmKernel(NativeKernel):
    """``y = x @ W.T (+ bias)`` in bfloat16 over a weight packed once into 16-column panels of
    interleaved k-pairs (AVX512_BF16's ``vdpbf16ps``), accumulated in float32 and rounded to bf16 as
    ``.to(torch.bfloat16)`` rounds.

    Why it exists: oneDNN's bf16 GEMM is not batch invariant (a row's bits change with the number of rows
    in the call), so a bf16 run on it is not either. Here each output is one float32 chain over k in a
    fixed order whatever M is, so each row's bits are those it gets alone. On AMX CPUs the same packed
    weight is read as AMX tiles (``bf16_amx.h``), the k blocks in the same fixed order."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = bind(lib, "bm_bf16_gemm", PTR, INT, PTR, PTR, PTR, *[INT] * 5)

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        """``[N, K]`` bf16 -> ``[ceil(N / 16), ceil(K / 2), 16, 2]``: per panel, k-pair-major, each
        column's two k values adjacent (the layout ``vdpbf16ps`` reads); zero-padded past N and K."""
        n, k = weight.shape
        panels, pairs = -(-n // PANEL), -(-k // 2)
        padded = weight.new_zeros(panels * PANEL, pairs * 2)
        padded[:n, :k] = weight
        return padded.view(panels, PANEL, pairs, 2).transpose(1, 2).contiguous()

    def __call__(
        self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int
    ) -> torch.Tensor:
        """``x`` [..., K] bfloat16; ``packed`` from :meth:`pack`; returns [..., n] bfloat16."""
        require("bf16 GEMM", BF16, (x, packed, bias), (packed, bias))
        k = x.shape[-1]
        if packed.shape[1:] != (-(-k // 2), PANEL, 2):
            raise ValueError(f"bf16 GEMM: x {tuple(x.shape)} against packed {tuple(packed.shape)}")
        if packed.shape[0] * PANEL < n or (bias is not None and bias.numel() != n):
            raise ValueError(f"bf16 GEMM: {n} outputs do not fit the packed weight or the bias")
        rows = as_rows(x)
        out = torch.empty(rows.shape[0], n, dtype=BF16)
        status = self._fn(
            rows.data_ptr(), rows.stride(0), packed.data_ptr(), pointer(bias), out.data_ptr(), n,
            rows.shape[0], n, k, torch.get_num_threads(),
        )  # fmt: skip
        if status:
            raise RuntimeError(f"bf16 GEMM: the compiled kernel refused its arguments ({status})")
        return out.view(*x.shape[:-1], n)


def _available(lib: ctypes.CDLL) -> Bf16GemmKernel | None:
    return Bf16GemmKernel(lib) if lib.bm_bf16_gemm_available() == 1 else None


def bf16_gemm_kernel(isa: str | None = None) -> Bf16GemmKernel | None:
    """The compiled batch-invariant bf16 GEMM, or None where neither of its builds (AMX, AVX512_BF16) is
    the one this CPU (and ``BM_CPU_ISA``) selects, or it cannot be built
    (:func:`bm.runtime.native.loader.load_kernel`). Where the AMX build cannot run (a compiler without
    AMX, or a kernel that refuses the process AMX's tile state) the AVX512_BF16 build runs instead.
    Nothing is compiled where it would have no code."""
    variant = kernel_isa("bf16_gemm", isa)
    if variant not in BF16_GEMM_BUILDS:
        return None
    kernel = load_kernel("bf16_gemm", _available, isa)
    if kernel is None and variant == "amx_bf16":
        kernel = load_variant("bf16_gemm", _available, "avx512_bf16")
    return kernel


def emulated_amx_gemm() -> Bf16GemmKernel | None:
    """The AMX build's path with each tile instruction done in C (the ``amx_emulated`` build, which no
    CPU is given): its blocking, padding and epilogue, tested on any CPU. Slow; or None without a
    compiler."""
    return load_variant("bf16_gemm", _available, "amx_emulated")
