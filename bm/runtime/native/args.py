"""The one check of what a compiled kernel assumes of its tensors, and the ctypes values made from them.

The C code reads raw pointers with the strides it is given and trusts them: a float64 tensor, a CUDA
one, or a transposed view passed as contiguous would read or write out of bounds, not fail. So every
wrapper checks its tensors here before the call (:func:`require`: dtype, device, contiguity), then
adds the shape relations of its own kernel. The checks are plain attribute reads: the wrappers run per
layer and forward, hundreds of times a step.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch

F32 = torch.float32
BF16 = torch.bfloat16
I64 = torch.int64
# ctypes argument types, as the kernels' C signatures declare them
PTR = ctypes.c_void_p
INT = ctypes.c_int64
FLOAT = ctypes.c_float


def bind(lib: ctypes.CDLL, symbol: str, *argtypes: Any, restype: Any = ctypes.c_int) -> Any:
    """``lib``'s C function ``symbol`` with its signature declared (``restype`` None for a void one)."""
    fn = getattr(lib, symbol)
    fn.restype = restype
    fn.argtypes = list(argtypes)
    return fn


def fits(
    dtype: torch.dtype,
    tensors: tuple[torch.Tensor | None, ...],
    contiguous: tuple[torch.Tensor | None, ...] = (),
) -> bool:
    """Whether every tensor of ``tensors`` is ``dtype`` on the CPU and every one of ``contiguous`` is
    contiguous (None entries, absent optional arguments, are skipped)."""
    for t in tensors:
        if t is not None and (t.dtype != dtype or not t.is_cpu):
            return False
    for t in contiguous:  # noqa: SIM110 (a loop, not a generator per call: this runs per layer)
        if t is not None and not t.is_contiguous():
            return False
    return True


def require(
    kernel: str,
    dtype: torch.dtype,
    tensors: tuple[torch.Tensor | None, ...],
    contiguous: tuple[torch.Tensor | None, ...] = (),
) -> None:
    """Raise ValueError, naming ``kernel`` and the first tensor that is off, unless :func:`fits`."""
    if fits(dtype, tensors, contiguous):
        return
    for t in tensors:
        if t is not None and (t.dtype != dtype or not t.is_cpu):
            raise ValueError(f"{kernel}: expected {dtype} CPU tensors, got {t.dtype} on {t.device}")
    bad = next(t for t in contiguous if t is not None and not t.is_contiguous())
    raise ValueError(
        f"{kernel}: a tensor it reads as one block is not contiguous "
        f"(shape {tuple(bad.shape)}, strides {bad.stride()})"
    )


def pointer(t: torch.Tensor | None) -> int | None:
    """The address of an optional tensor argument (None: NULL, the C code's "absent")."""
    return None if t is None else t.data_ptr()


def unit_stride(x: torch.Tensor) -> torch.Tensor:
    """``x`` with unit stride along its last dimension (the one the kernels vectorize over), copying
    only where it has another."""
    return x if x.stride(-1) == 1 else x.contiguous()


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as [rows, cols] with unit column stride and one row stride a kernel can step by (no
    overlapping rows), copying only where the view cannot give that."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < rows.shape[1]):
        rows = rows.contiguous()
    return rows


def kernel_inputs(
    tensors: tuple[torch.Tensor, ...], dtypes: tuple[torch.dtype, ...], device_type: str
) -> bool:
    """Whether ``tensors`` share one dtype of ``dtypes`` on ``device_type``, with autograd off: what the
    fused chains' kernels (the C passes, or bm.runtime.triton.elementwise on CUDA) take."""
    dtype = tensors[0].dtype
    return (
        dtype in dtypes
        and not torch.is_grad_enabled()
        and all(t.dtype == dtype and t.device.type == device_type for t in tensors)
    )


class BoundGemm:
    """A GEMM over one layer's weight, its weight and bias checked once when bound: each call then checks
    only ``x`` (float32 on the CPU, ``k`` inputs), allocates the output and calls ``launch(rows address,
    row stride, output address, rows, threads)`` (the kernel's C function with the weight's addresses
    bound), which returns its status (0: done). What a quantized linear runs per layer and step: the
    checks of an unbound call (:func:`require`, the shape relations) cost about half of a one-row call's
    time there. The binder keeps the tensors the addresses point into alive, and binds again when they
    change (bm.runtime.weight_quant.KernelForward)."""

    __slots__ = ("_keep", "_launch", "k", "n", "what")

    def __init__(self, what: str, k: int, n: int, launch: Callable[..., int], keep: tuple) -> None:
        self.what, self.k, self.n = what, k, n
        self._launch = launch
        self._keep = keep  # the tensors whose addresses launch holds

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [..., K] float32 on the CPU; returns [..., N] float32."""
        if x.dtype != F32 or not x.is_cpu or x.shape[-1] != self.k:
            raise ValueError(
                f"{self.what}: x {tuple(x.shape)} {x.dtype} on {x.device}, float32 CPU rows of {self.k} expected"
            )
        if x.is_contiguous():  # rows of k, read in place; the output made in x's shape (no views)
            out = torch.empty((*x.shape[:-1], self.n), dtype=F32)
            status = self._launch(
                x.data_ptr(), self.k, out.data_ptr(), x.numel() // self.k, torch.get_num_threads()
            )
        else:
            rows = as_rows(x)
            out = torch.empty(rows.shape[0], self.n, dtype=F32)
            status = self._launch(
                rows.data_ptr(), rows.stride(0), out.data_ptr(), rows.shape[0], torch.get_num_threads()
            )
            out = out.view(*x.shape[:-1], self.n)
        if status:
            raise ValueError(f"{self.what}: the compiled kernel refused its arguments ({status})")
        return out
