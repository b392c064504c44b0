"""The torch backend's attention arithmetic: prefill runs and decode groups over the paged cache.

Gathering a request's blocks along dim 2 of a layer's cache ``[2, kv_heads, num_blocks, block_size, d]``
yields ``[kv_heads, tokens, d]`` ready for a batched matmul, and grouped query heads are handled by
viewing the query as ``[kv_heads, group, ...]``: expanded K/V are never materialized. Whole prompts and
chunks after a cached prefix go to the compiled causal kernel where it computes exactly their attention
(``native/prefill_attention.c``), else to SDPA; soft-capping, ALiBi and sink logits write the scores
out (:func:`_scores_attention`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bm.runtime.attention import NO_EXTRAS, LayerCall, LayerExtras
from bm.runtime.backends.torch_layout import DecodeGroup, PrefillSegment
from bm.runtime.kv_quant import NO_SCALES, cache_head_dim, dequantize_rows, is_quantized
from bm.runtime.native import PrefillAttentionKernel, prefill_attention_kernel


def _scores_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scaling: float,
    extra: LayerExtras,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
) -> torch.Tensor:
    """Attention with the scores written out, for soft-capping, ALiBi and sink logits.

    ``q`` [kv_heads, B, group, L, d]; ``k``/``v`` [kv_heads, B, K, d]; ``allowed`` bool or additive
    float, broadcastable to [B, L, K]; ``query_pos`` [B, L] and ``key_pos`` [B, K] for ALiBi.
    """
    scores = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scaling  # [kv_heads, B, group, L, K]
    if extra.softcap is not None:
        scores = torch.tanh(scores / extra.softcap) * extra.softcap
    if extra.alibi is not None:
        slopes = extra.alibi.to(scores.dtype).view(q.shape[0], 1, q.shape[2], 1, 1)
        distance = (key_pos[:, None, :] - query_pos[:, :, None]).to(scores.dtype)  # [B, L, K]
        scores = scores + slopes * distance[None, :, None]
    if allowed.dtype == torch.bool:
        scores = scores.masked_fill(~allowed[None, :, None], float("-inf"))
    else:
        scores = scores + allowed[None, :, None]
    if extra.sinks is None:
        return torch.matmul(scores.softmax(-1), v.unsqueeze(2))  # [kv_heads, B, group, L, d]
    # one extra logit per head that takes probability mass and contributes no value
    sink = extra.sinks.to(scores.dtype).view(q.shape[0], 1, q.shape[2], 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
    return torch.matmul(probs, v.unsqueeze(2))


def prefill(
    out: torch.Tensor,
    call: LayerCall,
    cache: torch.Tensor,
    seg: PrefillSegment,
    kv_scales: tuple[float, float] = NO_SCALES,
) -> None:
    """One prefill run's attention into ``out[seg.start:seg.end]``: the compiled causal kernel where it
    computes exactly this run's, else SDPA; with soft-capping, ALiBi or sink logits, the scores written
    out. ``kv_scales``: an fp8 cache's key and value scales (bm.runtime.kv_quant)."""
    q, k, v, scaling = call.query, call.key, call.value, call.scaling
    if call.extras:
        _prefill_scores(out, call, cache, seg, kv_scales)
        return
    kernel = _native_prefill(q, cache, seg)
    if kernel is not None:
        # A quantized cache is dequantized as the kernel packs it, so a chunk after a cached prefix sums
        # exactly as the whole prompt did (whose keys, the call's own, forward_layer widened from the
        # same rows).
        kernel(
            out,
            q,
            k,
            v,
            seg.start,
            seg.end,
            scaling,
            cache,
            seg.block_ids,
            seg.prefix_len,
            kv_scales=kv_scales,
        )
        return
    qs = q[None, :, seg.start : seg.end]
    if seg.block_ids is None:
        # A whole prompt in one chunk: its keys are right here, no need to read the cache.
        ks, vs = k[None, :, seg.start : seg.end], v[None, :, seg.start : seg.end]
        if seg.mask is None:
            res = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scaling, enable_gqa=True)
        else:  # longer than the attention window
            res = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=seg.mask, scale=scaling, enable_gqa=True
            )
    else:
        kv = _gathered(cache, seg, q.dtype, kv_scales)
        res = F.scaled_dot_product_attention(
            qs, kv[0][None], kv[1][None], attn_mask=seg.mask, scale=scaling, enable_gqa=True
        )
    out[seg.start : seg.end] = res[0].transpose(0, 1)


def _pair(kv_scales: tuple[float, float]) -> torch.Tensor:
    """An fp8 cache's key and value scales as a tensor that scales a gathered ``[2, ...]`` pair."""
    return torch.tensor(kv_scales, dtype=torch.float32).view(2, 1, 1, 1, 1)


def _gathered(
    cache: torch.Tensor, seg: PrefillSegment, dtype: torch.dtype, kv_scales: tuple[float, float]
) -> torch.Tensor:
    """The keys and values ``[2, kv_heads, keys, d]`` a run after a cached prefix reads: its blocks
    gathered from the cache (a quantized cache's rows widened to ``dtype``), cut to the mask's keys."""
    kv_heads, head_dim = cache.shape[1], cache_head_dim(cache)
    blocks = cache.index_select(2, seg.block_ids)
    if is_quantized(cache):
        blocks = dequantize_rows(blocks, dtype, _pair(kv_scales))
    return blocks.view(2, kv_heads, -1, head_dim)[:, :, : seg.mask.shape[-1]]


def _native_prefill(
    q: torch.Tensor, cache: torch.Tensor, seg: PrefillSegment
) -> PrefillAttentionKernel | None:
    """The compiled kernel where it computes exactly this segment's attention, else None (SDPA).

    It does plain causal attention only: a whole prompt without a mask, or a chunk after a cached prefix
    whose gather is the request's first blocks in order (no ``key_pos``, one key per position). Masks of
    an attention window stay with SDPA. Its vector builds (AVX2, AVX-512) are faster than SDPA; its
    scalar build runs too (``BM_CPU_ISA=scalar``, or a CPU without AVX2), slower than SDPA but, unlike
    it, giving each row the same result however the prompt is chunked (batch invariance). A bf16 query
    (a bf16 model's, over its bf16 cache) needs the AVX-512 build, the one with the bf16 kernel.
    """
    if not PrefillAttentionKernel.handles(q.device, q.dtype) or q.shape[-1] % 8:
        return None
    kernel = prefill_attention_kernel()
    if kernel is None or q.dtype not in kernel.dtypes:
        return None
    if seg.block_ids is None:
        if seg.mask is not None:
            return None
    elif (
        seg.key_pos is not None
        or seg.mask is None
        or seg.mask.shape[-1] != seg.prefix_len + seg.end - seg.start
        or (cache.dtype != q.dtype and not (is_quantized(cache) and q.dtype == torch.float32))
        or not cache.is_contiguous()
    ):
        return None
    return kernel


def _prefill_scores(
    out: torch.Tensor,
    call: LayerCall,
    cache: torch.Tensor,
    seg: PrefillSegment,
    kv_scales: tuple[float, float],
) -> None:
    q, k, v = call.query, call.key, call.value
    kv_heads, head_dim = cache.shape[1], cache_head_dim(cache)
    length = seg.end - seg.start
    dev = q.device
    query_pos = torch.arange(seg.prefix_len, seg.prefix_len + length, device=dev)
    if seg.block_ids is None:
        ks, vs = k[:, seg.start : seg.end], v[:, seg.start : seg.end]
        key_pos = query_pos
        allowed = seg.mask if seg.mask is not None else key_pos[None, :] <= query_pos[:, None]
    else:
        ks, vs = _gathered(cache, seg, q.dtype, kv_scales)
        key_pos = seg.key_pos if seg.key_pos is not None else torch.arange(ks.shape[1], device=dev)
        allowed = seg.mask
    qg = q[:, seg.start : seg.end].reshape(kv_heads, -1, length, head_dim)[:, None]  # [kvh, 1, g, L, d]
    res = _scores_attention(
        qg, ks[:, None], vs[:, None], allowed[None], call.scaling, call.extras, query_pos[None], key_pos[None]
    )
    out[seg.start : seg.end] = res[:, 0].reshape(-1, length, head_dim).transpose(0, 1)


def decode(
    out: torch.Tensor,
    q: torch.Tensor,
    cache: torch.Tensor,
    group: DecodeGroup,
    scaling: float,
    scratch: torch.Tensor | None,
    extra: LayerExtras = NO_EXTRAS,
    kv_scales: tuple[float, float] = NO_SCALES,
) -> None:
    """One decode group's attention into its rows of ``out``: the group's blocks gathered (into
    ``scratch`` where it is large enough) and attended in one fused SDPA call. ``kv_scales``: an fp8
    cache's key and value scales."""
    kv_heads, _, block_size = cache.shape[1:4]
    head_dim, quantized = cache_head_dim(cache), is_quantized(cache)
    num_heads = q.shape[0]
    group_size = num_heads // kv_heads
    rows = group.token_index.numel()
    length = group.num_blocks * block_size
    # [heads, B, d] -> [kv_heads, B, group, d]: a reshape of the query instead of repeating K/V, so the
    # kv heads are SDPA's batch and the requests its heads; each request's keys are its own "head".
    qg = q.index_select(1, group.token_index).view(kv_heads, group_size, rows, head_dim).transpose(1, 2)

    shape = (kv_heads, rows * group.num_blocks, block_size, head_dim)
    numel = kv_heads * rows * length * head_dim
    use_scratch = not quantized and scratch is not None and scratch.numel() >= 2 * numel
    keys = torch.index_select(
        cache[0], 1, group.block_ids, out=scratch[:numel].view(shape) if use_scratch else None
    )
    values = torch.index_select(
        cache[1], 1, group.block_ids, out=scratch[numel : 2 * numel].view(shape) if use_scratch else None
    )
    if quantized:  # a quantized cache's rows, widened to the query's dtype
        keys = dequantize_rows(keys, q.dtype, kv_scales[0])
        values = dequantize_rows(values, q.dtype, kv_scales[1])
    if extra:
        key_pos = group.key_pos
        if key_pos is None:
            key_pos = torch.arange(length, device=q.device).expand(rows, length)
        res = _scores_attention(
            qg[:, :, :, None],  # one query per row: [kv_heads, B, group, 1, d]
            keys.view(kv_heads, rows, length, head_dim),
            values.view(kv_heads, rows, length, head_dim),
            group.row_bias[:, None, :],
            scaling,
            extra,
            group.query_pos[:, None],
            key_pos,
        )[:, :, :, 0]
        out.index_copy_(0, group.token_index, res.permute(1, 0, 2, 3).reshape(rows, num_heads, head_dim))
        return
    # One fused kernel (scores never materialized) instead of baddbmm + softmax + bmm: about 1.5-2x
    # faster on CPU at decode shapes. The row bias masks each request's padding past its length.
    res = F.scaled_dot_product_attention(
        qg,
        keys.view(kv_heads, rows, length, head_dim),
        values.view(kv_heads, rows, length, head_dim),
        attn_mask=group.row_bias[None, :, None, :],
        scale=scaling,
    )  # [kv_heads, B, group, d]
    res = res.permute(1, 0, 2, 3).reshape(rows, num_heads, head_dim)
    out.index_copy_(0, group.token_index, res)
