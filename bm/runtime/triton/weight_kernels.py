"""The quantized linears' GEMM as a Triton kernel: ``y = x @ W.T (+ bias)`` with ``W`` held in the packed
panels bm's CPU kernels read (bm.runtime.native.small_gemm.pack_panels), expanded in registers.

Why the CPU's layout: a panel is 16 outputs' weights, k-major, so a program's ``BLOCK_K x 16`` slice of
one panel is one contiguous run of bytes, which loads coalesced; keeping one format means a quantized
layer moves between devices with ``.to()``, and the CPU and GPU paths read the very same integers.

Two weight formats, chosen by ``ROW_SCALE``:

* int8 on load (``model.quantization: int8``): ``values`` int8 ``[P, K, 16]``, ``step`` one float32 per
  output ``[N]``. The small integers go to the dot as they are (exact in bfloat16 and float16, |q| <=
  127) and each output's sum is scaled once at its end, as the CPU kernel does.
* groups (GGUF Q4_0/Q4_1/Q8_0, GPTQ, AWQ, FP8; bm.runtime.group_linears): ``values`` uint8, two 4-bit
  values a byte (element ``2j`` in the low nibble of pair ``j``, ``[P, K / 2, 16]``) or one 8-bit integer
  or e4m3 code a byte (``[P, K, 16]``); ``step`` and ``offset`` float32 ``[P, K / GROUP, 16]``; each weight
  is ``u * d + m`` in float32 (one rounding), then rounded to the dot's dtype: the weight
  ``GroupWeight.expanded()`` gives, in the model's dtype, which is the reference's.

A 4-bit tile is two half-depth dots, the low nibbles against x's even columns and the high ones against
its odd columns, so no interleaving of nibbles is needed. ``GROUP`` is a multiple of ``BLOCK_K`` (the
launcher's rule), so a tile's weights share one step and offset per output; k past K is masked (a
tile's padding multiplies zeros).
"""

from __future__ import annotations

import triton
import triton.language as tl

from bm.runtime.triton.dots import dot, narrow

PANEL = tl.constexpr(16)  # outputs per panel: bm.runtime.native.small_gemm.PANEL


@triton.jit
def panel_linear_kernel(
    x_ptr,
    x_stride,
    w_ptr,
    step_ptr,
    offset_ptr,
    bias_ptr,
    out_ptr,
    out_stride,
    M,
    N,
    K,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    FLOAT8: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One ``BLOCK_M x BLOCK_N`` tile of ``y``, float32 sums over k in ``BLOCK_K`` steps; x's dtype is the
    dot's (``DOT``: bm.runtime.triton.dots)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_stride
    # element (k, n) of an 8-bit weight lies at panel(n) * K * 16 + k * 16 + n % 16 (a 4-bit one's pair
    # k / 2 at panel(n) * K / 2 * 16 + ...); a group's step and offset at panel(n) * K / GROUP * 16 + ...
    panel = (cols // PANEL).to(tl.int64)
    lane = cols % PANEL
    depth = K // 2 if BITS == 4 else K
    w_cols = w_ptr + panel * depth * PANEL + lane
    g_cols = panel * (K // GROUP) * PANEL + lane
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if not ROW_SCALE:
            g = g_cols + (k0 // GROUP) * PANEL
            d = tl.load(step_ptr + g, mask=col_ok, other=0.0)[None, :]
            m = tl.load(offset_ptr + g, mask=col_ok, other=0.0)[None, :]
        if BITS == 4:
            pairs = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            pair_ok = pairs < K // 2
            packed = tl.load(
                w_cols[None, :] + pairs[:, None] * PANEL, mask=pair_ok[:, None] & col_ok[None, :], other=0
            )
            low = (packed & 0x0F).to(tl.float32) * d + m
            high = (packed >> 4).to(tl.float32) * d + m
            x_ok = row_ok[:, None] & pair_ok[None, :]
            even = tl.load(x_rows + 2 * pairs[None, :], mask=x_ok, other=0.0)
            odd = tl.load(x_rows + 2 * pairs[None, :] + 1, mask=x_ok, other=0.0)
            acc += dot(even, narrow(low, even.dtype, DOT), DOT)
            acc += dot(odd, narrow(high, odd.dtype, DOT), DOT)
        else:
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            raw = tl.load(
                w_cols[None, :] + ks[:, None] * PANEL, mask=k_ok[:, None] & col_ok[None, :], other=0
            )
            if FLOAT8:
                u = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            else:
                u = raw.to(tl.int8, bitcast=True).to(tl.float32)
            w = u if ROW_SCALE else u * d + m
            x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            acc += dot(x, narrow(w, x.dtype, DOT), DOT)
    if ROW_SCALE:
        acc = acc * tl.load(step_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * out_stride + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
