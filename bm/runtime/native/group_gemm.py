"""The group-quantized GEMM (``group_gemm.c``): bm's CPU linears over a GGUF file's own Q4_0, Q4_1 and
Q8_0 blocks (:mod:`bm.runtime.gguf_weights`)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from bm.runtime.native.args import F32, INT, PTR, BoundGemm, bind, pointer, require
from bm.runtime.native.loader import NativeKernel, load_kernel
from bm.runtime.native.small_gemm import pack_panels, unpack_panels

U8 = torch.uint8


@dataclass(frozen=True)
class GroupWeight:
    """A weight ``W [N, K] = u * d + m``, ``u`` small integers, ``d`` and ``m`` one float32 each per
    output and group of ``group`` inputs, packed for :class:`GroupGemmKernel` (the layer's one copy)."""

    values: torch.Tensor  # uint8 panels: [P, K / 2, 16] (4 bits, two k steps a byte) or [P, K, 16] (8 bits)
    step: torch.Tensor  # float32 [P, K / group, 16]: d
    offset: torch.Tensor  # float32 [P, K / group, 16]: m
    bits: int
    group: int
    out_features: int
    float8: bool = False  # 8-bit values that are float8 e4m3 bytes (FP8 checkpoints), not integers

    @staticmethod
    def pack(
        u: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int, group: int, float8: bool = False
    ) -> GroupWeight:
        """``u [N, K]`` (0..15 for 4 bits; -128..127 for 8; e4m3 bytes as uint8 with ``float8``), ``d``
        and ``m`` ``[N, K / group]``."""
        n, k = u.shape
        if bits not in (4, 8) or group % 2 or k % group or d.shape != (n, k // group) or m.shape != d.shape:
            raise ValueError(
                f"group GEMM: {bits}-bit {tuple(u.shape)} in groups of {group}, d {tuple(d.shape)}"
            )
        if bits == 4:
            panels = pack_panels(u.to(U8))  # [P, K, 16]
            values = panels[:, 0::2] | (panels[:, 1::2] << 4)
        else:
            values = pack_panels(u.to(U8) if float8 else u.to(torch.int8)).view(U8)
        return GroupWeight(
            values.contiguous(), pack_panels(d.float()), pack_panels(m.float()), bits, group, n, float8
        )

    def expanded(self) -> torch.Tensor:
        """``W [N, K]`` in float32, each element ``u * d + m`` rounded once: the kernel's own weight."""
        if self.bits == 4:
            low, high = self.values & 0x0F, self.values >> 4
            u = torch.stack((low, high), 2).flatten(1, 2).float()  # [P, K, 16]
        elif self.float8:
            u = self.values.view(torch.float8_e4m3fn).float()
        else:
            u = self.values.view(torch.int8).float()
        d = self.step.repeat_interleave(self.group, 1)
        m = self.offset.repeat_interleave(self.group, 1)
        return unpack_panels(
            torch.addcmul(m, u, d), self.out_features
        )  # one rounding (u * d exact but e4m3's)


class GroupGemmKernel(NativeKernel):
    """``y = x @ W.T (+ bias)`` in float32 with ``W`` a :class:`GroupWeight`, expanded in registers.

    Why it exists: a GGUF file's 4-bit weights read an eighth of float32's bytes; torch has no CPU GEMM
    for these blocks, and expanding them to float32 on load gives the bytes back. Each output is the
    float32 panel GEMM's own chain over the expanded weight (bit for bit ``small_gemm.c`` on
    :meth:`GroupWeight.expanded`), so it is batch invariant and the same bits in every build."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = bind(lib, "bm_group_gemm", PTR, INT, PTR, INT, PTR, PTR, INT, PTR, PTR, *[INT] * 5)

    def __call__(self, x: torch.Tensor, weight: GroupWeight, bias: torch.Tensor | None) -> torch.Tensor:
        """``x`` [..., K] float32; ``bias`` [N] float32 or None; returns [..., N] float32: :meth:`bind`'s
        checks and call, once."""
        return self.bind(weight, bias)(x)

    def bind(self, weight: GroupWeight, bias: torch.Tensor | None) -> BoundGemm:
        """This GEMM over one layer's weight, checked once: each call of the result checks only ``x``."""
        require("group GEMM", F32, (weight.step, weight.offset, bias), (weight.step, weight.offset, bias))
        n, group = weight.out_features, weight.group
        k = weight.step.shape[1] * group
        if weight.values.dtype != U8 or not weight.values.is_contiguous() or not weight.values.is_cpu:
            raise ValueError(f"group GEMM: packed values {weight.values.dtype} on {weight.values.device}")
        if bias is not None and bias.shape != (n,):
            raise ValueError(f"group GEMM: {n} outputs, a bias of {tuple(bias.shape)}")
        fn, kind = self._fn, 3 if weight.float8 else weight.bits
        w, d, o, b = weight.values.data_ptr(), weight.step.data_ptr(), weight.offset.data_ptr(), pointer(bias)

        def launch(x: int, ldx: int, y: int, m: int, threads: int) -> int:
            return fn(x, ldx, w, kind, d, o, group, b, y, n, m, n, k, threads)

        return BoundGemm("group GEMM", k, n, launch, (weight.values, weight.step, weight.offset, bias))


def group_gemm_kernel(isa: str | None = None) -> GroupGemmKernel | None:
    """The compiled group-quantized GEMM (AVX-512 or plain C, the same bits), or None (see
    :func:`bm.runtime.native.loader.load_kernel`)."""
    return load_kernel("group_gemm", GroupGemmKernel, isa)
