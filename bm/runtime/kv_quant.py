"""int8 KV cache rows: each key or value row of one token and KV head stored as ``head_dim`` int8 values
and, after them, its own float32 scale (``kv_cache.dtype: int8``).

Why the scale lives in the row: the cache stays one tensor ``[2, kv_heads, blocks, block_size, head_dim
+ 4]`` of int8, so everything that moves blocks (beam forks' copies, prefix reuse, sizing, the warm-up's
touch) moves scales with them without knowing about them, and the KV cache keeps one owner.

Why per token and KV head: a row is quantized from its own values alone, so what a request's cache holds
never depends on what else was in its batch (batch invariance), and one outlier token costs precision
only in its own row. Symmetric: ``scale = max|x| / 127`` (1 for an all-zero row), ``q = round(x / scale)``
(half to even) in [-127, 127]; a read gives ``q * scale`` in float32, then the model's KV dtype.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # one float32 scale after each row's values
QMAX = 127.0


def is_quantized(cache: torch.Tensor) -> bool:
    """Whether a layer's cache holds int8 rows (each ending in its scale)."""
    return cache.dtype == torch.int8


def cache_head_dim(cache: torch.Tensor) -> int:
    """The head size of the keys a layer's cache holds (its last dimension, less an int8 row's scale)."""
    return cache.shape[-1] - (SCALE_BYTES if is_quantized(cache) else 0)


def stored_row(head_dim: int, kv_dtype: torch.dtype, cache_dtype: str) -> tuple[torch.dtype, int]:
    """The cache tensor's dtype and last dimension for rows of ``head_dim``: the model's KV dtype and
    ``head_dim``, or int8 and ``head_dim`` + the scale's bytes."""
    if cache_dtype == "int8":
        return torch.int8, head_dim + SCALE_BYTES
    return kv_dtype, head_dim


def row_bytes(head_dim: int, kv_dtype: torch.dtype, cache_dtype: str) -> int:
    """Bytes one key (or value) row of one KV head takes in the cache."""
    dtype, width = stored_row(head_dim, kv_dtype, cache_dtype)
    return width * torch.empty((), dtype=dtype).element_size()


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` [..., d] (float32 or bf16, d a multiple of 4) -> int8 rows [..., d + 4]: each row's values,
    then its scale's four bytes."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / QMAX
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    rows = torch.empty((*x.shape[:-1], x.shape[-1] + SCALE_BYTES), dtype=torch.int8, device=x.device)
    rows[..., : x.shape[-1]] = torch.round(xf / scale).clamp_(-QMAX, QMAX).to(torch.int8)
    rows[..., x.shape[-1] :] = scale.view(torch.int8)
    return rows


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows [..., d + 4] -> their values [..., d] in ``dtype``: ``q * scale`` in float32, then cast."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)
    values = rows[..., :d].to(torch.float32) * scale
    return values if dtype == torch.float32 else values.to(dtype)


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """``x`` as an int8 cache gives it back: what attention reads for keys and values it stored."""
    return dequantize_rows(quantize_rows(x), x.dtype)
