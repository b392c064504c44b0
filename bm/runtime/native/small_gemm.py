"""The panel GEMM behind bm's CPU linears (``small_gemm.c``), with its fused epilogues."""

from __future__ import annotations

import ctypes

import torch

from bm.runtime.native.args import F32, INT, PTR, BoundGemm, as_rows, bind, pointer, require
from bm.runtime.native.loader import SOURCES, NativeKernel, load_kernel

PANEL = 16  # output columns per packed weight panel in small_gemm.c
SOURCE = SOURCES / "small_gemm.c"


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` -> ``[ceil(N / 16), K, 16]`` panels, k-major, the last one zero-padded: the layout of
    this GEMM's weight, and of the int8-weight GEMM's (int8_gemm.c), in the weight's own dtype."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = weight.new_zeros(panels * PANEL, k)
    padded[:n] = weight
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


def unpack_panels(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The ``[N, K]`` weight back from :func:`pack_panels`' panels (a copy)."""
    return packed.transpose(1, 2).reshape(-1, packed.shape[1])[:n]


class SmallGemmKernel(NativeKernel):
    """``y = x @ W.T (+ bias)`` in float32 over a weight packed once into 16-column panels (AVX-512 or
    AVX2 + FMA register tiles; plain C in the scalar build).

    Faster than torch's default GEMM at every row count measured on SmolLM2-135M's shapes (AVX2 build on
    an AVX2 EPYC: 1.05-1.1x at 2,048 rows, 1.3-5x at 1-64) and than oneDNN with a prepacked weight
    (1.0-1.9x); the AVX-512 build is 1.4-1.9x the AVX2 one from 8 rows up (``benchmarks/cpu_isa.py``).
    Each output row is computed alone, in one order, so results do not depend on the rest of the batch.
    """

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = bind(lib, "bm_small_gemm_f32", PTR, INT, PTR, PTR, PTR, *[INT] * 5)
        self._ex = bind(lib, "bm_small_gemm_f32_ex", PTR, INT, PTR, PTR, PTR, PTR, INT, PTR, *[INT] * 5)
        # The fused epilogues (SiLU-gated pair, residual add) exist in the AVX-512 build only: elsewhere the
        # caller runs the separate ops, which compute the same values.
        self.fuses_epilogues = bool(lib.bm_small_gemm_avx512())

    pack = staticmethod(pack_panels)

    def __call__(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        bias: torch.Tensor | None,
        n: int,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x`` [..., K] float32; ``packed`` from :meth:`pack`; returns [..., n], plus ``residual``
        ([..., n], added after the bias as torch's ``residual + linear(x)`` does) where given: only where
        :attr:`fuses_epilogues`."""
        if residual is None:  # the plain product: bind's checks and call, once
            return self.bind(packed, bias, n)(x)
        require("small GEMM", F32, (x, packed, bias, residual), (packed, bias))
        if packed.shape[1:] != (x.shape[-1], PANEL):
            raise ValueError(f"small GEMM: x {tuple(x.shape)} against packed {tuple(packed.shape)}")
        if packed.shape[0] * PANEL < n or (bias is not None and bias.numel() != n):
            raise ValueError(f"small GEMM: {n} outputs do not fit the packed weight or the bias")
        if residual is not None and residual.shape != (*x.shape[:-1], n):
            raise ValueError(
                f"small GEMM: residual {tuple(residual.shape)} for {n} outputs of x {tuple(x.shape)}"
            )
        return self._launch("small GEMM", x, packed, None, bias, residual, n)

    def bind(self, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> BoundGemm:
        """This GEMM over one layer's packed weight, checked once: each call of the result checks only
        ``x`` (bm.runtime.prepack binds each float32 linear's)."""
        require("small GEMM", F32, (packed, bias), (packed, bias))
        if packed.dim() != 3 or packed.shape[2] != PANEL:
            raise ValueError(f"small GEMM: packed {tuple(packed.shape)}, not panels of {PANEL}")
        if packed.shape[0] * PANEL < n or (bias is not None and bias.numel() != n):
            raise ValueError(f"small GEMM: {n} outputs do not fit the packed weight or the bias")
        fn, k, w, b = self._fn, packed.shape[1], packed.data_ptr(), pointer(bias)

        def launch(x: int, ldx: int, y: int, m: int, threads: int) -> int:
            return fn(x, ldx, w, b, y, n, m, n, k, threads)

        return BoundGemm("small GEMM", k, n, launch, (packed, bias))

    def gated(self, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, n: int) -> torch.Tensor:
        """``silu(x @ G^T) * (x @ U^T)`` from two packed weights of ``n`` outputs (a multiple of 16, no
        bias), bit for bit the two GEMMs and ElementwiseKernels.silu_mul; only where
        :attr:`fuses_epilogues`."""
        require("gated GEMM", F32, (x, gate, up), (gate, up))
        if (
            gate.shape != up.shape
            or gate.shape[1:] != (x.shape[-1], PANEL)
            or n % PANEL
            or gate.shape[0] * PANEL != n
        ):
            raise ValueError(
                f"gated GEMM: x {tuple(x.shape)} against {tuple(gate.shape)} and {tuple(up.shape)}"
            )
        return self._launch("gated GEMM", x, gate, up, None, None, n)

    def _launch(
        self,
        what: str,
        x: torch.Tensor,
        packed: torch.Tensor,
        up: torch.Tensor | None,
        bias: torch.Tensor | None,
        residual: torch.Tensor | None,
        n: int,
    ) -> torch.Tensor:
        """One call of the compiled GEMM's entry point with the fused epilogues (``up`` or ``residual``
        given; the plain product is :meth:`bind`'s) on checked arguments."""
        rows = as_rows(x)
        out = torch.empty(rows.shape[0], n, dtype=torch.float32)
        add = None if residual is None else as_rows(residual)
        status = self._ex(
            rows.data_ptr(), rows.stride(0), packed.data_ptr(), pointer(up), pointer(bias), pointer(add),
            0 if add is None else add.stride(0), out.data_ptr(), n, rows.shape[0], n, rows.shape[1],
            torch.get_num_threads(),
        )  # fmt: skip
        if status:
            raise RuntimeError(f"{what}: the compiled kernel refused its arguments ({status})")
        return out.view(*x.shape[:-1], n)


def small_gemm_kernel(isa: str | None = None) -> SmallGemmKernel | None:
    """The compiled panel GEMM (AVX-512, AVX2 or plain C: batch invariant in each), or None (see
    :func:`bm.runtime.native.loader.load_kernel`)."""
    return load_kernel(
        "small_gemm", lambda lib: SmallGemmKernel(lib) if lib.bm_small_gemm_available() == 1 else None, isa
    )
