"""A decoder layer's elementwise chains, each in one C pass (``elementwise.c``): RMSNorm, the residual
add with the RMSNorm after it, SiLU(gate) * up, and rotary embedding."""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from bm.runtime.native.args import FLOAT, INT, PTR, as_rows, bind, kernel_inputs, require
from bm.runtime.native.loader import NativeKernel, load_kernel


class ElementwiseKernels(NativeKernel):
    """A decoder layer's elementwise chains (RMSNorm, SiLU(gate) * up, rotary) each in one C pass, on
    float32 or bfloat16 tensors (the bf16 passes round each intermediate as torch's bf16 ops do).

    The callers (bm.runtime.fusion) check dtype, device and layout first (:meth:`accepts`); these methods
    only reshape and check what the C code would otherwise read out of bounds.
    """

    device_type = "cpu"

    @functools.cached_property  # read on every fused call; ``isa`` is set right after construction
    def dtypes(self) -> tuple[torch.dtype, ...]:
        """float32 in every build; bfloat16 in the AVX-512 one, whose passes convert sixteen lanes at a
        time (the plain C bf16 loops, left to the compiler, ran SiLU 6x slower than torch's own)."""
        return (torch.float32, torch.bfloat16) if self.isa == "avx512" else (torch.float32,)

    def __init__(self, lib: ctypes.CDLL) -> None:
        signatures = {
            "rms_norm": [PTR, INT, PTR, PTR, INT, INT, FLOAT, INT],
            "add_rms_norm": [PTR, INT, PTR, INT, PTR, PTR, PTR, INT, INT, FLOAT, INT],
            "silu_mul": [PTR, INT, PTR, INT, PTR, INT, INT, INT],
            "rotary": [PTR, INT, INT, PTR, PTR, PTR, INT, INT, INT, INT],
        }
        self._fns: dict[tuple[str, torch.dtype], Any] = {
            (name, dtype): bind(lib, f"bm_{name}_{suffix}", *argtypes, restype=None)
            for name, argtypes in signatures.items()
            for dtype, suffix in ((torch.float32, "f32"), (torch.bfloat16, "bf16"))
        }

    def accepts(self, *tensors: torch.Tensor) -> bool:
        """Whether these are tensors the C passes take: CPU, one dtype of :attr:`dtypes`, no autograd."""
        return kernel_inputs(tensors, self.dtypes, self.device_type)

    def _fn(self, name: str, *tensors: torch.Tensor, contiguous: tuple[torch.Tensor, ...] = ()) -> Any:
        """The pass ``name`` for the tensors' one dtype, after checking them (see bm.runtime.native.args)."""
        fn = self._fns.get((name, tensors[0].dtype))
        if fn is None:
            raise ValueError(f"{name} kernel: dtype {tensors[0].dtype}")
        require(f"{name} kernel", tensors[0].dtype, tensors, contiguous)
        return fn

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``weight * (x * rsqrt(mean(x**2, -1) + eps))`` over the last dimension, in ``x``'s dtype."""
        cols = x.shape[-1]
        if weight.shape != (cols,):
            raise ValueError(f"RMSNorm kernel: weight {tuple(weight.shape)} for rows of {cols}")
        fn = self._fn("rms_norm", x, weight, contiguous=(weight,))
        rows = as_rows(x)
        out = torch.empty(x.shape, dtype=x.dtype)
        fn(
            rows.data_ptr(), rows.stride(0), weight.data_ptr(), out.data_ptr(), rows.shape[0], cols, eps,
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    def add_rms_norm(
        self, a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(s, rms_norm(s, weight, eps))`` with ``s = a + b``, in one pass: a decoder layer's residual
        add and the norm after it, bitwise what ``a + b`` then :meth:`rms_norm` give."""
        cols = a.shape[-1]
        if a.shape != b.shape or weight.shape != (cols,):
            raise ValueError(
                f"add-RMSNorm kernel: a {tuple(a.shape)}, b {tuple(b.shape)}, weight {tuple(weight.shape)}"
            )
        fn = self._fn("add_rms_norm", a, b, weight, contiguous=(weight,))
        s = torch.empty(a.shape, dtype=a.dtype)
        out = torch.empty(a.shape, dtype=a.dtype)
        # Called twice per layer and forward: the contiguous inputs of a packed batch skip the row views.
        ra = a if a.is_contiguous() else as_rows(a)
        rb = b if b.is_contiguous() else as_rows(b)
        lda = cols if ra is a else ra.stride(0)
        ldb = cols if rb is b else rb.stride(0)
        fn(
            ra.data_ptr(), lda, rb.data_ptr(), ldb, weight.data_ptr(), s.data_ptr(), out.data_ptr(),
            s.numel() // cols if cols else 0, cols, eps, torch.get_num_threads(),
        )  # fmt: skip
        return s, out

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up``, same shapes, in their dtype."""
        if gate.shape != up.shape:
            raise ValueError(f"SiLU-mul kernel: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
        fn = self._fn("silu_mul", gate, up)
        g, u = as_rows(gate), as_rows(up)
        out = torch.empty(gate.shape, dtype=gate.dtype)
        fn(
            g.data_ptr(), g.stride(0), u.data_ptr(), u.stride(0), out.data_ptr(), g.shape[0], g.shape[1],
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x * cos + rotate_half(x) * sin`` for ``x`` [tokens, heads, d] (unit stride along d) and
        ``cos``/``sin`` [tokens, d]; returns a contiguous [tokens, heads, d] in ``x``'s dtype."""
        tokens, heads, d = x.shape
        if d % 2 or cos.shape != (tokens, d) or sin.shape != (tokens, d):
            raise ValueError(f"rotary kernel: x {tuple(x.shape)} with cos {tuple(cos.shape)}")
        fn = self._fn("rotary", x, cos, sin)
        if x.stride(2) != 1:
            x = x.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        out = torch.empty(tokens, heads, d, dtype=x.dtype)
        fn(
            x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
            tokens, heads, d, torch.get_num_threads(),
        )  # fmt: skip
        return out


def elementwise_kernels(isa: str | None = None) -> ElementwiseKernels | None:
    """The compiled elementwise chains, or None (see :func:`bm.runtime.native.loader.load_kernel`)."""
    return load_kernel("elementwise", ElementwiseKernels, isa)
