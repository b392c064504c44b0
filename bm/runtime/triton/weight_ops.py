"""Launching the quantized linears' Triton GEMM (:mod:`bm.runtime.triton.weight_kernels`): tile sizes,
the grid, and which formats it takes.

The tile sizes are Triton's usual starting point for a skinny GEMM, not yet measured on a GPU (no device
has been lent since the kernel was written; docs/gpu.md): ``BLOCK_N`` 64 (four panels), ``BLOCK_K`` 64
(32 where a group is 32 inputs, GGUF's blocks), ``BLOCK_M`` the smallest of 16, 32 and 64 that holds the
rows (decode steps are a few rows to a few hundred), 4 warps.
"""

from __future__ import annotations

import torch

from bm.runtime.native.small_gemm import PANEL
from bm.runtime.triton import load_kernels
from bm.runtime.triton.ops import dot_mode

BLOCK_N = 64
DOT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def block_k(group: int | None) -> int | None:
    """The k tile for weights in groups of ``group`` inputs (None: one scale per output row), or None
    where no tile of 64 or 32 divides the group (a 4-bit tile's half-depth dots need 16 pairs at least)."""
    if group is None:
        return 64
    return next((b for b in (64, 32) if group % b == 0), None)


def serves(dtype: torch.dtype, group: int | None) -> bool:
    """Whether :func:`panel_linear` takes activations of ``dtype`` against weights in groups of
    ``group`` (the layer falls back to torch's GEMM over the expanded weight otherwise)."""
    return dtype in DOT_DTYPES and block_k(group) is not None


def panel_linear(
    x: torch.Tensor,
    values: torch.Tensor,
    step: torch.Tensor,
    offset: torch.Tensor | None,
    bias: torch.Tensor | None,
    *,
    out_features: int,
    bits: int,
    group: int | None,
    float8: bool = False,
) -> torch.Tensor:
    """``x [..., K] @ W.T (+ bias)`` in ``x``'s dtype, ``W [out_features, K]`` packed in panels:

    * ``group`` None: int8 ``values [P, K, 16]``, ``step`` float32 ``[N]`` applied after each sum;
    * otherwise ``values`` uint8 (``bits`` 4: ``[P, K / 2, 16]``; 8: integers, or e4m3 codes with
      ``float8``: ``[P, K, 16]``), ``step`` and ``offset`` float32 ``[P, K / group, 16]``."""
    k = x.shape[-1]
    tile_k = block_k(group)
    if x.dtype not in DOT_DTYPES or tile_k is None:
        raise ValueError(f"panel GEMM: {x.dtype} activations in groups of {group}; see serves()")
    depth = k // 2 if bits == 4 else k
    if values.shape[1:] != (depth, PANEL) or values.shape[0] * PANEL < out_features:
        raise ValueError(f"panel GEMM: x {tuple(x.shape)} against {bits}-bit panels {tuple(values.shape)}")
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    out = torch.empty(m, out_features, dtype=x.dtype, device=x.device)
    block_m = next(b for b in (16, 32, 64) if m <= b or b == 64)
    grid = (-(-m // block_m), -(-out_features // BLOCK_N))
    if m:
        load_kernels("weight_kernels").panel_linear_kernel[grid](
            rows, rows.stride(0), values, step, step if offset is None else offset,
            step if bias is None else bias, out, out.stride(0), m, out_features, k,
            GROUP=k if group is None else group, BITS=bits, FLOAT8=float8, ROW_SCALE=group is None,
            HAS_BIAS=bias is not None, DOT=dot_mode(x.dtype),
            BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=tile_k, num_warps=4,
        )  # fmt: skip
    return out.view(*x.shape[:-1], out_features)
