"""Quantized KV cache rows (``kv_cache.dtype: int8 | fp8_e4m3``): what a key or value row of one token
and KV head becomes in the cache, and what attention reads back.

**int8**: ``head_dim`` int8 values and, after them, the row's own float32 scale. Why the scale lives in
the row: the cache stays one tensor ``[2, kv_heads, blocks, block_size, head_dim + 4]`` of int8, so
everything that moves blocks (beam forks' copies, prefix reuse, sizing, the warm-up's touch) moves
scales with them without knowing about them, and the KV cache keeps one owner. Why per token and KV
head: a row is quantized from its own values alone, so what a request's cache holds never depends on
what else was in its batch (batch invariance), and one outlier token costs precision only in its own
row. Symmetric: ``scale = max|x| / 127`` (1 for an all-zero row), ``q = round(x / scale)`` (half to even)
in [-127, 127]; a read gives ``q * scale`` in float32, then the model's KV dtype.

**fp8_e4m3**: ``head_dim`` float8 e4m3 values (``torch.float8_e4m3fn``), nothing else, with vLLM's
per-tensor convention: one key scale and one value scale per layer (the checkpoint's ``k_scale`` and
``v_scale``, else 1.0, as vLLM uses when a checkpoint has none). A store is ``fp8(clamp(x / scale,
±448))``, rounded to nearest even; a read is ``float32(q) * scale``. A layer's scales are constants of
the model, so a row still depends on its own values alone.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

SCALE_BYTES = 4  # one float32 scale after each int8 row's values
QMAX = 127.0
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value; a store saturates there (torch's cast would give NaN)
NO_SCALES = (1.0, 1.0)  # an fp8 layer's key and value scales where the checkpoint gives none (vLLM's too)


def is_quantized(cache: torch.Tensor) -> bool:
    """Whether a layer's cache holds quantized rows (int8 with their scales, or fp8)."""
    return cache.dtype in (torch.int8, FP8)


def cache_format(cache: torch.Tensor) -> str:
    """The ``kv_cache.dtype`` a layer's cache was built for: int8, fp8_e4m3, or auto."""
    return {torch.int8: "int8", FP8: "fp8_e4m3"}.get(cache.dtype, "auto")


def cache_head_dim(cache: torch.Tensor) -> int:
    """The head size of the keys a layer's cache holds (its last dimension, less an int8 row's scale)."""
    return cache.shape[-1] - (SCALE_BYTES if cache.dtype == torch.int8 else 0)


def stored_row(head_dim: int, kv_dtype: torch.dtype, cache_dtype: str) -> tuple[torch.dtype, int]:
    """The cache tensor's dtype and last dimension for rows of ``head_dim``: the model's KV dtype and
    ``head_dim``; int8 and ``head_dim`` + the scale's bytes; or fp8 and ``head_dim``."""
    if cache_dtype == "int8":
        return torch.int8, head_dim + SCALE_BYTES
    if cache_dtype == "fp8_e4m3":
        return FP8, head_dim
    return kv_dtype, head_dim


def row_bytes(head_dim: int, kv_dtype: torch.dtype, cache_dtype: str) -> int:
    """Bytes one key (or value) row of one KV head takes in the cache."""
    dtype, width = stored_row(head_dim, kv_dtype, cache_dtype)
    return width * torch.empty((), dtype=dtype).element_size()


def quantize_rows(x: torch.Tensor, cache_dtype: str = "int8", scale: float = 1.0) -> torch.Tensor:
    """``x`` [..., d] (float32 or bf16) -> cache rows: int8 [..., d + 4] (each row's values, then its
    scale's four bytes; d a multiple of 4), or fp8 [..., d] at the layer's per-tensor ``scale``."""
    xf = x.float()
    if cache_dtype == "fp8_e4m3":
        return (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)  # torch takes the scale as a float32
    row_scale = xf.abs().amax(-1, keepdim=True) / QMAX
    row_scale = torch.where(row_scale == 0, torch.ones_like(row_scale), row_scale)
    rows = torch.empty((*x.shape[:-1], x.shape[-1] + SCALE_BYTES), dtype=torch.int8, device=x.device)
    rows[..., : x.shape[-1]] = torch.round(xf / row_scale).clamp_(-QMAX, QMAX).to(torch.int8)
    rows[..., x.shape[-1] :] = row_scale.view(torch.int8)
    return rows


def dequantize_rows(
    rows: torch.Tensor, dtype: torch.dtype, scale: float | torch.Tensor = 1.0
) -> torch.Tensor:
    """Cache rows -> their values [..., d] in ``dtype``: ``q * scale`` in float32, then cast. An int8
    row carries its scale; fp8 rows take ``scale`` (a float, or a tensor broadcasting over ``rows``, as
    ``[2, 1, ...]`` for a gathered key and value pair)."""
    if rows.dtype == FP8:
        values = rows.to(torch.float32) * scale
    else:
        d = rows.shape[-1] - SCALE_BYTES
        values = rows[..., :d].to(torch.float32) * rows[..., d:].contiguous().view(torch.float32)
    return values if dtype == torch.float32 else values.to(dtype)


def round_trip(x: torch.Tensor, cache_dtype: str = "int8", scale: float = 1.0) -> torch.Tensor:
    """``x`` as a quantized cache gives it back: what attention reads for keys and values it stored."""
    return dequantize_rows(quantize_rows(x, cache_dtype, scale), x.dtype, scale)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor seen as its bytes, for the copies torch does not implement for float8 on the CPU
    (``index_copy_``); any other tensor as it is."""
    return t.view(torch.uint8) if t.dtype == FP8 else t


# Where checkpoints keep a layer's fp8 KV scales: llm-compressor and compressed-tensors write
# ``self_attn.k_scale``, AutoFP8 ``self_attn.k_proj.output_scale`` (both read by vLLM).
_SCALE_KEY = re.compile(r"layers\.(\d+)\.self_attn\.(?:attn\.)?(?:([kv])_scale|([kv])_proj\.output_scale)$")


def checkpoint_kv_scales(path: Path) -> dict[int, tuple[float, float]]:
    """Per layer, the key and value scales a checkpoint's safetensors carry (1.0 where a layer gives
    one of them only); empty where it has none. Only the scale tensors themselves are read."""
    from safetensors import safe_open

    found: dict[int, list[float]] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as tensors:
            names = tensors.keys()  # safe_open's handle lists its tensors through keys() only
            for key in names:
                match = _SCALE_KEY.search(key)
                if match is None:
                    continue
                layer, which = int(match[1]), match[2] or match[3]
                value = float(tensors.get_tensor(key).float().reshape(-1)[0])  # a float32's value
                found.setdefault(layer, [*NO_SCALES])[0 if which == "k" else 1] = value
    return {layer: (k, v) for layer, (k, v) in sorted(found.items())}
