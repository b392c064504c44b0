"""Every LoRA adapter's delta of one linear for a whole packed batch, in one call (``lora_delta.c``)."""

from __future__ import annotations

import ctypes

import torch

from bm.runtime.native.args import F32, I64, INT, PTR, bind, require
from bm.runtime.native.loader import NativeKernel, load_kernel

_NAME = "LoRA kernel"


class _LoraWeightsStruct(ctypes.Structure):
    _fields_ = [
        ("a", ctypes.c_void_p),
        ("b", ctypes.c_void_p),
        ("rank", ctypes.c_void_p),
        ("slots", ctypes.c_int64),
        ("R", ctypes.c_int64),
        ("K", ctypes.c_int64),
        ("N", ctypes.c_int64),
    ]


class LoraDeltaWeights:
    """One linear's stacked adapters as the LoRA kernel reads them: checked once, when they are
    (re)allocated, so the per-forward call only passes a pointer. Holds the tensors it points into."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, rank: torch.Tensor) -> None:
        slots, r, k = a.shape
        require(_NAME, F32, (a, b), (a, b))
        require(_NAME, I64, (rank,), (rank,))
        if b.shape[:2] != (slots, r) or rank.shape != (slots,):
            raise ValueError(
                f"{_NAME}: A {tuple(a.shape)}, B {tuple(b.shape)} and rank {tuple(rank.shape)} must be "
                "[slots, R, K], [slots, R, N] and [slots]"
            )
        self.tensors = (a, b, rank)
        self.in_features, self.out_features = k, b.shape[2]
        self.struct = _LoraWeightsStruct(a.data_ptr(), b.data_ptr(), rank.data_ptr(), slots, r, k, b.shape[2])
        self.ref = ctypes.byref(self.struct)


class LoraDeltaKernel(NativeKernel):
    """``y[row] += (x[row] @ A[s].T) @ B[s]`` for each row with adapter slot ``s >= 0``, in one call per
    linear (``native/lora_delta.c``). Built on every CPU: with AVX2 + FMA it runs vector code, elsewhere
    the same loops in plain C."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = bind(lib, "bm_lora_delta_f32", PTR, INT, PTR, INT, PTR, INT, PTR, INT)
        self.avx2 = lib.bm_lora_delta_avx2() == 1

    def __call__(
        self, x: torch.Tensor, y: torch.Tensor, first: int, slots: torch.Tensor, weights: LoraDeltaWeights
    ) -> None:
        """Rows ``first .. first + len(slots)`` of ``x`` [..., K] and ``y`` [..., N] (contiguous float32,
        read as rows); ``slots`` int64, -1 for rows left alone. ``y`` is updated in place."""
        k, n = weights.in_features, weights.out_features
        rows = slots.shape[0]
        require(_NAME, F32, (x, y), (x, y))
        require(_NAME, I64, (slots,), (slots,))
        if (
            x.shape[-1] != k
            or y.shape[-1] != n
            or first < 0
            or (first + rows) * k > x.numel()
            or (first + rows) * n > y.numel()
        ):
            raise ValueError(
                f"{_NAME}: x {tuple(x.shape)}, y {tuple(y.shape)} and rows {first}..{first + rows} do not fit "
                f"weights [{k} -> {n}]"
            )
        status = self._fn(
            x.data_ptr() + 4 * first * k, k, y.data_ptr() + 4 * first * n, n, slots.data_ptr(), rows,
            weights.ref, torch.get_num_threads(),
        )  # fmt: skip
        if status:
            raise ValueError(f"{_NAME}: an adapter's rank exceeds its stacked rows")


def lora_delta_kernel(isa: str | None = None) -> LoraDeltaKernel | None:
    """The compiled LoRA delta kernel, or None (see :func:`bm.runtime.native.loader.load_kernel`)."""
    return load_kernel("lora_delta", LoraDeltaKernel, isa)
