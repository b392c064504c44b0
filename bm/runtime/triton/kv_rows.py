"""A paged cache's rows as the Triton kernels write and read them: the model's KV dtype as it is, or the
quantized rows of ``kv_cache.dtype: int8 | fp8_e4m3`` (:mod:`bm.runtime.kv_quant` defines them; these
are the same rows, bit for bit, written in registers).

Shared by the attention kernels' KV store and reads (:mod:`bm.runtime.triton.kernels`) and the fused
rotary-and-store kernel (:mod:`bm.runtime.triton.elementwise_kernels`), so the row format lives in one
place on the GPU as it does on the CPU.

Why the rounding is written out instead of left to Triton's casts: the compiled kernels would round as
torch does (``cvt.rn``), but Triton 3.6's interpreter, which the CPU tests run, rounds float32 to fp8 its
own way (some ties away from zero, some to the wrong power of two, negative zeros made positive). An
fp8 byte is therefore assembled from integer operations on a value rounded with exact float32 ones,
and an int8 value rounded the same way before its (exact) cast, so the interpreter tests what the GPU
runs. Divisions are ``div_rn``: Triton's ``/`` is an approximate division on CUDA.
"""

from __future__ import annotations

import triton
import triton.language as tl

# How a cache stores its rows (the kernels' KV_QUANT argument)
KV_FULL = 0  # the model's KV dtype, stored and read as it is
KV_INT8 = 1  # int8 values, then the row's own float32 scale in the next four bytes
KV_FP8 = 2  # float8 e4m3 values at the layer's key (or value) scale


@triton.jit
def _round_half_even(t):
    """``t`` (|t| < 2**22) rounded to an integer, ties to even, as torch.round: adding 1.5 * 2**23 leaves
    one unit per float32 step, so the add rounds and the subtraction is exact."""
    return (t + 12582912.0) - 12582912.0


@triton.jit
def _e4m3_code(y):
    """The float8 e4m3 byte nearest ``y`` (float32 within ±448), ties to even, as uint8: ``y`` is first
    rounded to e4m3's grid in float32 (the step at its binade is ``2**(e - 3)``, three mantissa bits;
    ``2**-9`` below the smallest normal binade, e4m3's subnormals), exactly, since scaling by powers of
    two is exact; the byte is then assembled from the rounded value's bits, its sign (a negative
    zero's too) in the top bit."""
    bits = y.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    exp = tl.maximum((mag >> 23) - 127, -6)
    step = ((exp + 124) << 23).to(tl.float32, bitcast=True)  # 2 ** (exp - 3)
    inv = ((130 - exp) << 23).to(tl.float32, bitcast=True)  # 2 ** (3 - exp)
    snapped = _round_half_even(mag.to(tl.float32, bitcast=True) * inv) * step
    s_bits = snapped.to(tl.int32, bitcast=True)
    s_exp = (s_bits >> 23) - 127  # a rounding up may have reached the next binade
    normal = ((s_exp + 7) << 3) | ((s_bits >> 20) & 7)
    subnormal = (snapped * 512.0).to(tl.int32)  # k * 2**-9, k < 8 (0 for zero)
    code = tl.where(s_exp >= -6, normal, subnormal) | tl.where(bits < 0, 128, 0)
    return code.to(tl.uint8)


@triton.jit
def store_rows(
    cache_ptr, row_start, x, row_ok, d_ok, scale,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, KV_QUANT: tl.constexpr,
):  # fmt: skip
    """Write rows ``x [R, HEAD_PAD]`` (the model's dtype) at ``row_start [R]`` (int64 offsets into the
    cache, in its elements), rows ``row_ok`` and columns ``d_ok`` only. int8: each row at its own scale
    ``max|x| / 127`` (1 for an all-zero row), ``round(x / scale)`` in [-127, 127], the scale after the
    values; fp8: ``x / scale`` (the layer's ``scale``) saturated at ±448 and rounded to e4m3."""
    offs_d = tl.arange(0, HEAD_PAD)
    dst = cache_ptr + row_start[:, None] + offs_d[None, :]
    ok = row_ok[:, None] & d_ok[None, :]
    if KV_QUANT == 0:
        tl.store(dst, x, mask=ok)
    elif KV_QUANT == 1:
        xf = tl.where(ok, x.to(tl.float32), 0.0)
        row_scale = tl.math.div_rn(tl.max(tl.abs(xf), 1), 127.0)
        row_scale = tl.where(row_scale == 0.0, 1.0, row_scale)
        q = _round_half_even(tl.math.div_rn(xf, row_scale[:, None]))
        tl.store(dst, tl.minimum(tl.maximum(q, -127.0), 127.0).to(tl.int8), mask=ok)
        scale_ptr = (cache_ptr + row_start + HEAD_DIM).to(tl.pointer_type(tl.float32))
        tl.store(scale_ptr, row_scale, mask=row_ok)
    else:
        y = tl.math.div_rn(x.to(tl.float32), scale)
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        tl.store(dst.to(tl.pointer_type(tl.uint8)), _e4m3_code(y), mask=ok)


@triton.jit
def widen(raw, scale_ptr, scale, ok, dtype: tl.constexpr, KV_QUANT: tl.constexpr):
    """A tile of cache values ``raw`` as the model's ``dtype``: as they are, or ``q * scale`` in float32
    and then cast, as :func:`bm.runtime.kv_quant.dequantize_rows` gives them. ``scale_ptr`` (int8: the
    tile's row scales, pointers shaped to broadcast over ``raw``, loaded where ``ok``) or ``scale``
    (fp8: the layer's)."""
    if KV_QUANT == 0:
        out = raw
    elif KV_QUANT == 1:
        row_scale = tl.load(scale_ptr.to(tl.pointer_type(tl.float32)), mask=ok, other=0.0)
        out = (raw.to(tl.float32) * row_scale).to(dtype)
    else:
        out = (raw.to(tl.float32) * scale).to(dtype)
    return out
