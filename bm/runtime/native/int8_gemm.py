"""The int8-weight GEMM (``int8_gemm.c``): bm's CPU linears under ``model.quantization: int8``."""

from __future__ import annotations

import ctypes

import torch

from bm.runtime.native.args import F32, INT, PTR, BoundGemm, bind, pointer, require
from bm.runtime.native.loader import NativeKernel, load_kernel
from bm.runtime.native.small_gemm import PANEL, pack_panels, unpack_panels

I8 = torch.int8


class Int8GemmKernel(NativeKernel):
    """``y = (x @ Q.T) * scale (+ bias)`` in float32 over int8 weights ``Q [N, K]`` with one float32
    scale per output, packed once into 16-output panels (the layer's only copy of its weight).

    Why it exists: torch's int8 weight-only CPU GEMM (``torch._weight_int8pack_mm``) has no vector path
    for float32 activations (25-40× slower than float32's own GEMM on this EPYC), and a float32 GEMM
    over a widened copy reads four times the bytes quantization saved. Each output is one float32 chain
    over k in order whatever M is (batch invariant), the same bits in every build."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = bind(lib, "bm_int8_gemm", PTR, INT, PTR, PTR, PTR, PTR, *[INT] * 5)

    # the float32 panel GEMM's layout (small_gemm.c), in int8
    pack = staticmethod(pack_panels)
    unpack = staticmethod(unpack_panels)

    def __call__(
        self, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x`` [..., K] float32; ``packed`` from :meth:`pack`; ``scale`` [N] and ``bias`` [N] float32;
        returns [..., N] float32: :meth:`bind`'s checks and call, once."""
        return self.bind(packed, scale, bias)(x)

    def bind(self, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> BoundGemm:
        """This GEMM over one layer's weight, checked once: each call of the result checks only ``x``."""
        require("int8 GEMM", F32, (scale, bias), (scale, bias))
        require("int8 GEMM", I8, (packed,), (packed,))
        n, k = scale.shape[0], packed.shape[1]
        if packed.dim() != 3 or packed.shape[2] != PANEL or packed.shape[0] * PANEL < n:
            raise ValueError(f"int8 GEMM: packed {tuple(packed.shape)} for {n} outputs")
        if bias is not None and bias.shape != (n,):
            raise ValueError(f"int8 GEMM: {n} outputs, a bias of {tuple(bias.shape)}")
        fn, w, s, b = self._fn, packed.data_ptr(), scale.data_ptr(), pointer(bias)

        def launch(x: int, ldx: int, y: int, m: int, threads: int) -> int:
            fn(x, ldx, w, s, b, y, n, m, n, k, threads)
            return 0  # void: it takes every shape bind let through

        return BoundGemm("int8 GEMM", k, n, launch, (packed, scale, bias))


def int8_gemm_kernel(isa: str | None = None) -> Int8GemmKernel | None:
    """The compiled int8-weight GEMM (AVX-512 or plain C, the same bits), or None (see
    :func:`bm.runtime.native.loader.load_kernel`)."""
    return load_kernel("int8_gemm", Int8GemmKernel, isa)
