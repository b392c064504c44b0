"""The decoder layer's elementwise chains as Triton kernels (RMSNorm with or without the residual add
before it, SiLU(gate) * up, rotary embedding), for :class:`bm.runtime.triton.elementwise.TritonElementwise`.

Each computes transformers' formula with its roundings, in the tensor's dtype, one program per row
(token). Kept apart from the attention kernels (:mod:`bm.runtime.triton.kernels`): the two sets share
nothing but the way they load (:func:`bm.runtime.triton.load_kernels`, compiled or interpreted) and the
paged cache's layout, which :func:`rotary_store_kv_kernel` writes the rotated keys into.
"""

from __future__ import annotations

import triton
import triton.language as tl

from bm.runtime.triton.kv_rows import store_rows


@triton.jit
def rms_norm_kernel(
    x_ptr,
    x_stride,
    b_ptr,
    b_stride,
    w_ptr,
    sum_ptr,
    out_ptr,
    cols,
    eps,
    BLOCK: tl.constexpr,
    ADD: tl.constexpr,
):
    """``w * (x * rsqrt(mean(x**2) + eps)).to(dtype)`` per row; with ADD, ``x = (x + b).to(dtype)`` first
    (stored to ``sum_ptr``): the residual add, rounded to the model's dtype as torch's add rounds it."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < cols
    x = tl.load(x_ptr + row * x_stride + offs, mask=ok, other=0.0)
    dtype = x.dtype
    if ADD:
        x = x.to(tl.float32) + tl.load(b_ptr + row * b_stride + offs, mask=ok, other=0.0).to(tl.float32)
        x = x.to(dtype)
        tl.store(sum_ptr + row * cols + offs, x, mask=ok)
    x = x.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(x * x, 0) / cols + eps)
    y = (x * inv).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * cols + offs, (w * y).to(dtype), mask=ok)


@triton.jit
def silu_mul_kernel(g_ptr, g_stride, u_ptr, u_stride, out_ptr, cols, BLOCK: tl.constexpr):
    """``silu(g).to(dtype) * u`` per row, rounded as torch's two ops round."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < cols
    g = tl.load(g_ptr + row * g_stride + offs, mask=ok, other=0.0)
    dtype = g.dtype
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(dtype).to(tl.float32)
    u = tl.load(u_ptr + row * u_stride + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * cols + offs, (act * u).to(dtype), mask=ok)


@triton.jit
def _rotated(
    x_ptr, x_stride_t, x_stride_h, cos_ptr, sin_ptr, heads, token,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """``x * cos + rotate_half(x) * sin`` for one token's heads ``[BLOCK_H, HEAD_PAD]`` in the dtype, each
    product and the sum rounded to the dtype as torch's three ops round them (launched without FMA
    contraction), and the mask of the real heads and dimensions."""
    half: tl.constexpr = HEAD_DIM // 2
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_DIM
    ok = (offs_h < heads)[:, None] & d_ok[None, :]
    base = x_ptr + token * x_stride_t + offs_h[:, None] * x_stride_h
    x = tl.load(base + offs_d[None, :], mask=ok, other=0.0)
    dtype = x.dtype
    partner = tl.where(offs_d < half, offs_d + half, offs_d - half)
    sign = tl.where(offs_d < half, -1.0, 1.0)
    rot = tl.load(base + partner[None, :], mask=ok, other=0.0).to(tl.float32) * sign[None, :]
    c = tl.load(cos_ptr + token * HEAD_DIM + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + token * HEAD_DIM + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    a = (x.to(tl.float32) * c[None, :]).to(dtype).to(tl.float32)
    b = (rot.to(dtype).to(tl.float32) * s[None, :]).to(dtype).to(tl.float32)
    return (a + b).to(dtype), ok


@triton.jit
def _rotate_heads(
    x_ptr, x_stride_t, x_stride_h, cos_ptr, sin_ptr, out_ptr, heads, token,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """:func:`_rotated` of one token's heads, written to ``out`` ``[tokens, heads, HEAD_DIM]``."""
    y, ok = _rotated(
        x_ptr, x_stride_t, x_stride_h, cos_ptr, sin_ptr, heads, token, HEAD_DIM, HEAD_PAD, BLOCK_H
    )
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_PAD)
    tl.store(out_ptr + token * heads * HEAD_DIM + offs_h[:, None] * HEAD_DIM + offs_d[None, :], y, mask=ok)


@triton.jit
def rotary_kernel(
    x_ptr,
    x_stride_t,
    x_stride_h,
    cos_ptr,
    sin_ptr,
    out_ptr,
    heads,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Rotary embedding of one token's heads of one tensor (:func:`_rotate_heads`)."""
    token = tl.program_id(0).to(tl.int64)
    _rotate_heads(
        x_ptr, x_stride_t, x_stride_h, cos_ptr, sin_ptr, out_ptr, heads, token, HEAD_DIM, HEAD_PAD, BLOCK_H
    )


@triton.jit
def rotary_pair_kernel(
    q_ptr, q_stride_t, q_stride_h, k_ptr, k_stride_t, k_stride_h, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
    q_heads, k_heads,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
):  # fmt: skip
    """The queries' and the keys' rotary embedding in one launch: programs ``(token, 0)`` rotate the
    token's query heads, ``(token, 1)`` its key heads. One kernel per layer instead of two, in a decode
    step whose kernels are each a few microseconds long (SmolLM2's 30 layers: 60 launches become 30)."""
    token = tl.program_id(0).to(tl.int64)
    if tl.program_id(1) == 0:
        _rotate_heads(
            q_ptr, q_stride_t, q_stride_h, cos_ptr, sin_ptr, q_out_ptr, q_heads, token, HEAD_DIM, HEAD_PAD, BLOCK_HQ
        )  # fmt: skip
    else:
        _rotate_heads(
            k_ptr, k_stride_t, k_stride_h, cos_ptr, sin_ptr, k_out_ptr, k_heads, token, HEAD_DIM, HEAD_PAD, BLOCK_HK
        )  # fmt: skip


@triton.jit
def rotary_store_kv_kernel(
    q_ptr, q_stride_t, q_stride_h, k_ptr, k_stride_t, k_stride_h, v_ptr, v_stride_t, v_stride_h,
    cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    c_stride_h, c_stride_b, c_stride_t, q_heads, k_heads, k_scale, v_scale,
    TOKENS_PER_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, KV_QUANT: tl.constexpr,
):  # fmt: skip
    """The queries' rotary embedding, and the keys' written with the values straight into the layer's
    paged cache (``[kv_heads, blocks, TOKENS_PER_BLOCK, HEAD_DIM]`` each, bm's layout): programs
    ``(token, 0)`` rotate the token's query heads into ``q_out``, ``(token, 1)`` rotate its key heads and
    store them and its value heads at the token's slot (a negative slot is a padding row: nothing is
    stored). The rotated keys are never written anywhere else: the Triton backend's attention reads keys
    from the cache only. One launch where :func:`rotary_pair_kernel` and the attention kernels' KV store
    took two, with the same bits in the queries and the cache. A quantized cache's rows are quantized
    as the attention kernels' store quantizes them (:func:`bm.runtime.triton.kv_rows.store_rows`)."""
    token = tl.program_id(0).to(tl.int64)
    if tl.program_id(1) == 0:
        _rotate_heads(
            q_ptr, q_stride_t, q_stride_h, cos_ptr, sin_ptr, q_out_ptr, q_heads, token, HEAD_DIM, HEAD_PAD, BLOCK_HQ
        )  # fmt: skip
    else:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:
            key, ok = _rotated(
                k_ptr, k_stride_t, k_stride_h, cos_ptr, sin_ptr, k_heads, token, HEAD_DIM, HEAD_PAD, BLOCK_HK
            )  # fmt: skip
            offs_h = tl.arange(0, BLOCK_HK)
            offs_d = tl.arange(0, HEAD_PAD)
            value = tl.load(
                v_ptr + token * v_stride_t + offs_h[:, None] * v_stride_h + offs_d[None, :], mask=ok
            )
            row = (slot // TOKENS_PER_BLOCK) * c_stride_b + (slot % TOKENS_PER_BLOCK) * c_stride_t
            row += offs_h * c_stride_h
            row_ok, d_ok = offs_h < k_heads, offs_d < HEAD_DIM
            store_rows(k_cache_ptr, row, key, row_ok, d_ok, k_scale, HEAD_DIM, HEAD_PAD, KV_QUANT)
            store_rows(v_cache_ptr, row, value, row_ok, d_ok, v_scale, HEAD_DIM, HEAD_PAD, KV_QUANT)
