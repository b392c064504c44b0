"""Launching the Triton kernels: tile sizes, grids, and the per-layer extras (soft-cap, ALiBi, sinks).

:func:`paged_attention` computes what bm's torch reference path computes for the same batch (see
``bm/runtime/attention.py``), for every feature bm supports: GQA, attention windows with sink tokens,
Gemma 2's soft-capping, ALiBi slopes and gpt-oss's per-head sink logits.
"""

from __future__ import annotations

import torch

from bm.runtime.triton import load_kernels
from bm.runtime.triton.batch import PagedBatch

# The largest head size the kernel takes; larger heads go to the torch path (docs/gpu.md).
MAX_HEAD_DIM = 256


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1): Triton's tile extents must be powers of two."""
    return 1 << (n - 1).bit_length()


def supports_head_dim(head_dim: int) -> bool:
    return head_dim <= MAX_HEAD_DIM


def store_kv(cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` ``[kv_heads, T, d]`` into ``cache`` at ``slot_mapping`` (one launch)."""
    kernels = load_kernels()
    kv_heads, num_tokens, head_dim = key.shape
    if num_tokens == 0:
        return
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    if value.stride() != key.stride():
        value = value.contiguous()
        key = key.contiguous()
    kernels.store_kv_kernel[(num_tokens, kv_heads)](
        key, value, cache[0], cache[1], slot_mapping,
        key.stride(0), key.stride(1),
        cache.stride(1), cache.stride(2), cache.stride(3),
        TOKENS_PER_BLOCK=cache.shape[3], HEAD_DIM=head_dim, HEAD_PAD=next_pow2(head_dim),
    )  # fmt: skip


def paged_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    cache: torch.Tensor,
    batch: PagedBatch,
    scale: float,
    softcap: float | None = None,
    alibi: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    block_n: int | None = None,
) -> None:
    """Attention of every query ``q [heads, T, d]`` to its sequence's cached keys, into ``out [T, heads, d]``.

    ``alibi``/``sinks``: ``[heads]`` float32 slopes / sink logits. One launch for the whole batch.
    """
    kernels = load_kernels()
    num_heads, num_tokens, head_dim = q.shape
    if num_tokens == 0:
        return
    kv_heads, tokens_per_block = cache.shape[1], cache.shape[3]
    group = num_heads // kv_heads
    # 16 query rows (a tensor-core tile) per program for decode; 64 when prompts are in the batch so a
    # long prompt's keys are read by fewer programs.
    block_m = max(16 if batch.max_query_len == 1 else 64, next_pow2(group))
    block_q = max(1, block_m // group)
    if block_n is None:
        block_n = 64 if head_dim <= 128 else 32
    q = _last_dim_contiguous(q)
    dummy = cache  # unused pointer arguments (the feature flags keep the kernel from reading them)
    window = batch.window
    grid = (num_tokens // block_q + batch.num_seqs, kv_heads)
    kernels.paged_attention_kernel[grid](
        out, q, cache[0], cache[1], batch.block_table, batch.seq_lens, batch.cu_seqlens,
        sinks if sinks is not None else dummy, alibi if alibi is not None else dummy,
        float(scale), float(softcap or 0.0), int(window or 0), int(batch.sink_tokens), batch.num_seqs,
        batch.block_table.stride(0), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        cache.stride(1), cache.stride(2), cache.stride(3),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        HEAD_DIM=head_dim, HEAD_PAD=max(16, next_pow2(head_dim)), TOKENS_PER_BLOCK=tokens_per_block,
        USE_SOFTCAP=softcap is not None, USE_ALIBI=alibi is not None, USE_SINKS=sinks is not None,
        USE_WINDOW=window is not None, DOT=_dot_mode(kernels, q.dtype),
    )  # fmt: skip


def _dot_mode(kernels, dtype: torch.dtype) -> int:
    import triton

    if dtype == torch.float32:
        return kernels.DOT_IEEE
    return kernels.DOT_UPCAST if triton.knobs.runtime.interpret else kernels.DOT_FAST


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
