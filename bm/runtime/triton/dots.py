"""How bm's Triton kernels multiply tiles: one ``dot`` and its three modes, shared by the attention
kernels (:mod:`bm.runtime.triton.kernels`) and the quantized linears' GEMM
(:mod:`bm.runtime.triton.weight_kernels`), so both choose IEEE float32 and work around the interpreter
the same way."""

from __future__ import annotations

import triton
import triton.language as tl

# A kernel's DOT argument
DOT_FAST = 0  # bf16/fp16 on tensor cores (fp32 accumulation); TF32 for fp32 inputs
DOT_IEEE = 1  # full fp32: what a float32 model asks for, so bm's fp32 output equals HF's
DOT_UPCAST = 2  # operands widened to fp32 first: Triton 3.6's interpreter gets bf16 dots wrong


@triton.jit
def dot(a, b, DOT: tl.constexpr):
    if DOT == 2:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif DOT == 1:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def narrow(w, dtype: tl.constexpr, DOT: tl.constexpr):
    """float32 ``w`` rounded to ``dtype`` (to nearest, ties to even), for a dot in ``dtype``. Triton
    3.6's interpreter truncates float32 to bfloat16 (``DOT_UPCAST`` runs only there), so there the
    rounding is done on the bits and the value kept in float32, which the upcast dot takes as it is."""
    if DOT == 2 and dtype == tl.bfloat16:
        bits = w.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        out = bits.to(tl.float32, bitcast=True)
    else:
        out = w.to(dtype)
    return out
