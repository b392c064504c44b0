"""Paged attention, plugged into transformers through its public attention registry.

The model runs one packed, unpadded sequence of tokens (``[1, T]``) that holds every scheduled request:
context chunks and single generation tokens side by side. transformers computes the projections and
rotary embeddings as usual and calls :func:`paged_attention_forward` once per layer. The batch metadata
does not travel as a forward kwarg: some decoder layers (stablelm's, for one) drop ``**kwargs`` before
calling attention, so the runner sets it for the duration of each forward (:func:`batch_metadata`) and the
attention function reads it from there. That function writes the new keys and values into
the preallocated block tensors by slot mapping, then attends each sequence to its own blocks only.

KV layout per layer: ``[2, num_kv_heads, num_blocks, tokens_per_block, head_dim]``. Gathering a
request's blocks along dim 2 yields ``[num_kv_heads, tokens, head_dim]`` ready for a batched matmul,
and grouped query heads are handled by viewing the query as ``[kv_heads, group, ...]``: expanded K/V
are never materialized.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from bm.engine.executor import WorkItem
from bm.runtime.native import PagedDecodeKernel, PrefillAttentionKernel, prefill_attention_kernel

ATTENTION_NAME = "bm_paged"

# Attention features some models pass per layer that bm does not implement, so a model using them fails
# loudly instead of running with silently different attention. (A native sliding window is honoured by
# the runner instead, per layer: see ModelRunner; soft-capping and ALiBi are implemented below.)
_UNSUPPORTED_KWARGS = {"sinks": "attention sinks passed as 'sinks'"}
# Set on an attention module by an adapter (bm.runtime.adapters): per query head ALiBi slopes, float32.
ALIBI_ATTR = "bm_alibi_slopes"


class UnsupportedAttentionError(RuntimeError):
    pass


def segment_rows(segment: WorkItem, offset: int) -> range:
    """The packed rows whose logits a forward returns for a work item starting at ``offset``: every row
    with ``keep_all``, the drafts' and the last with drafts, the last when it samples. One definition
    for the torch and the Triton paths."""
    n = len(segment.token_ids)
    if segment.keep_all:
        return range(offset, offset + n)
    if segment.num_draft:
        return range(offset + n - 1 - segment.num_draft, offset + n)
    return range(offset + n - 1, offset + n) if segment.sample else range(0)


@dataclass
class PrefillSegment:
    """A run of two or more query tokens of one request (a context chunk)."""

    start: int  # first token in the packed batch
    end: int
    prefix_len: int  # tokens already in the cache before this chunk
    # The blocks to read keys from, when prefix_len > 0: the request's first blocks, or under an
    # attention window only those holding attended keys (sink blocks, then the window's).
    block_ids: torch.Tensor | None = None
    # [L, keys] bool: keys are the gathered blocks' slots (prefix_len + L of them without a window), or
    # the chunk's own keys when nothing is gathered and the chunk is longer than the window.
    mask: torch.Tensor | None = None
    # [keys] positions of the mask's keys, where they are not simply 0, 1, ... (windowed gathers); read
    # only by ALiBi, whose bias depends on the distance between query and key.
    key_pos: torch.Tensor | None = None


@dataclass
class DecodeGroup:
    """Single-token queries of similar context length, attended together in one fused attention call."""

    token_index: torch.Tensor  # [B] positions in the packed batch
    block_ids: torch.Tensor  # [B * num_blocks] flattened, padded block tables
    num_blocks: int
    row_bias: torch.Tensor  # [B, num_blocks * tokens_per_block]: 0 where attended, -inf past the end
    query_pos: torch.Tensor | None = None  # [B], for ALiBi
    key_pos: torch.Tensor | None = None  # [B, num_blocks * tokens_per_block] where not 0, 1, ... (ALiBi)


@dataclass
class NativeDecode:
    """Every single-token query of the batch, for the compiled kernel that reads blocks in place."""

    kernel: Callable[..., None]
    token_index: torch.Tensor  # [B] positions in the packed batch
    block_table: torch.Tensor  # [B, max_blocks] int64, rows padded with block 0 past their length
    lengths: torch.Tensor  # [B] int64: keys each query attends (its position + 1)
    max_len: int
    window: int | None = None  # each query attends only its last ``window`` keys


@dataclass
class AttentionMetadata:
    kv_caches: list[
        torch.Tensor | None
    ]  # by layer_idx, [2, kv_heads, num_blocks, tokens_per_block, head_dim]
    slot_mapping: torch.Tensor  # [T] flat slot of each new token
    prefill: list[PrefillSegment] = field(default_factory=list)
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    native_decode: NativeDecode | None = None  # instead of decode_groups, where the kernel is available
    # The compiled kernel's KV write (PagedDecodeKernel.write_kv), where it is available: the same copy
    # as index_copy_, several times faster on the strided rows the projections leave.
    kv_writer: PagedDecodeKernel | None = None
    scratch: torch.Tensor | None = None  # reusable gather buffer, sized for the largest decode group
    probe: dict[int, tuple[int, int]] | None = None  # set by probe_kv_shapes: record shapes, compute nothing
    # Layers that attend differently from this metadata's layout (another attention window), by layer_idx.
    layers: dict[int, AttentionMetadata] | None = None
    # The Triton path's batch (bm.runtime.triton.batch.PagedBatch): when set, it replaces every field
    # above but kv_caches, and the kernels serve the whole batch in one launch per layer.
    paged: Any = None


_current = threading.local()


@contextmanager
def batch_metadata(meta: AttentionMetadata) -> Iterator[None]:
    """Make ``meta`` the metadata every paged attention call reads until the block exits.

    Per thread, so two runners in two threads never see each other's batch; nested uses restore the outer.
    """
    previous = getattr(_current, "meta", None)
    _current.meta = meta
    try:
        yield
    finally:
        _current.meta = previous


def in_bm_forward() -> bool:
    """Whether a bm forward is in progress on this thread (adapted modules otherwise run their own code)."""
    return getattr(_current, "meta", None) is not None


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    meta: AttentionMetadata | None = getattr(_current, "meta", None)
    if meta is None:
        raise UnsupportedAttentionError(
            "bm's paged attention ran outside a bm forward: a model set to it runs only inside "
            "ModelRunner.forward (the runner owns the KV cache it writes to)"
        )
    for name, feature in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise UnsupportedAttentionError(
                f"this model uses {feature} ({name!r} in its attention call), which bm does not implement"
            )
    if meta.probe is not None:
        return _record_shape(module, query, key, value, meta.probe)
    if meta.layers:
        meta = meta.layers.get(module.layer_idx, meta)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    sinks = kwargs.get("s_aux")
    extra = _Extras(
        kwargs.get("softcap") or None,
        getattr(module, ALIBI_ATTR, None),
        None if sinks is None else sinks.detach().float().contiguous(),
    )

    cache = meta.kv_caches[module.layer_idx]
    if meta.paged is not None:
        return _triton_attention(query, key, value, cache, meta.paged, scaling, extra), None
    kv_heads, num_blocks, block_size, head_dim = cache.shape[1:]
    q, k, v = query[0], key[0], value[0]  # [heads, T, d], [kv_heads, T, d]
    if cache.dtype != q.dtype:  # a bfloat16 model's float32 cache on CPU (LoadedModel.kv_dtype)
        q, k, v = q.to(cache.dtype), k.to(cache.dtype), v.to(cache.dtype)
    if meta.kv_writer is None or not meta.kv_writer.write_kv(cache, meta.slot_mapping, k, v):
        flat = cache.view(2, kv_heads, num_blocks * block_size, head_dim)
        flat[0].index_copy_(1, meta.slot_mapping, k)
        flat[1].index_copy_(1, meta.slot_mapping, v)

    num_heads, num_tokens, _ = q.shape
    out = q.new_empty(num_tokens, num_heads, head_dim)
    for seg in meta.prefill:
        _prefill(out, q, k, v, cache, seg, scaling, extra)
    for group in meta.decode_groups:
        _decode(out, q, cache, group, scaling, meta.scratch, extra)
    nd = meta.native_decode
    if nd is not None:
        nd.kernel(
            out, q, cache, nd.token_index, nd.block_table, nd.lengths, nd.max_len, scaling,
            extra.softcap, extra.alibi, nd.window, extra.sinks,
        )  # fmt: skip
    return out.to(query.dtype).unsqueeze(0), None


@dataclass(slots=True)
class _Extras:
    """Per-layer changes to the scores that a fused SDPA call cannot express."""

    softcap: float | None  # Gemma 2: scores become softcap * tanh(scores / softcap)
    alibi: torch.Tensor | None  # [heads] slopes: slope * (key - query) is added to each score
    # [heads] float32: gpt-oss's learned sink logit per head, in the softmax's denominator only
    sinks: torch.Tensor | None = None

    def __bool__(self) -> bool:
        return self.softcap is not None or self.alibi is not None or self.sinks is not None


NO_EXTRAS = _Extras(None, None)


def _triton_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: torch.Tensor,
    batch: Any,
    scaling: float,
    extra: _Extras,
) -> torch.Tensor:
    """The GPU path: store the new keys/values, then one paged attention launch for the whole batch."""
    from bm.runtime.triton.ops import paged_attention, store_kv

    q = query[0]
    store_kv(cache, key[0], value[0], batch.slot_mapping)
    out = q.new_empty(q.shape[1], q.shape[0], q.shape[2])
    paged_attention(out, q, cache, batch, scaling, extra.softcap, extra.alibi, extra.sinks)
    return out.unsqueeze(0)


def _scores_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scaling: float,
    extra: _Extras,
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


def _prefill(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    seg: PrefillSegment,
    scaling: float,
    extra: _Extras,
) -> None:
    if extra:
        _prefill_scores(out, q, k, v, cache, seg, scaling, extra)
        return
    kernel = _native_prefill(q, cache, seg)
    if kernel is not None:
        kernel(out, q, k, v, seg.start, seg.end, scaling, cache, seg.block_ids, seg.prefix_len)
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
        kv_heads, head_dim = cache.shape[1], cache.shape[4]
        blocks = cache.index_select(2, seg.block_ids)
        kv = blocks.view(2, kv_heads, -1, head_dim)[:, :, : seg.mask.shape[-1]]
        res = F.scaled_dot_product_attention(
            qs, kv[0][None], kv[1][None], attn_mask=seg.mask, scale=scaling, enable_gqa=True
        )
    out[seg.start : seg.end] = res[0].transpose(0, 1)


def _native_prefill(
    q: torch.Tensor, cache: torch.Tensor, seg: PrefillSegment
) -> PrefillAttentionKernel | None:
    """The compiled kernel where it computes exactly this segment's attention, else None (SDPA).

    It does plain causal attention only: a whole prompt without a mask, or a chunk after a cached prefix
    whose gather is the request's first blocks in order (no ``key_pos``, one key per position). Masks of
    an attention window stay with SDPA. Its vector builds (AVX2, AVX-512) are faster than SDPA; its
    scalar build runs too (``BM_CPU_ISA=scalar``, or a CPU without AVX2), slower than SDPA but, unlike
    it, giving each row the same result however the prompt is chunked (batch invariance).
    """
    if not PrefillAttentionKernel.handles(q.device, q.dtype) or q.shape[-1] % 8:
        return None
    if seg.block_ids is None:
        if seg.mask is not None:
            return None
    elif (
        seg.key_pos is not None
        or seg.mask is None
        or seg.mask.shape[-1] != seg.prefix_len + seg.end - seg.start
        or cache.dtype != torch.float32
        or not cache.is_contiguous()
    ):
        return None
    return prefill_attention_kernel()


def _prefill_scores(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    seg: PrefillSegment,
    scaling: float,
    extra: _Extras,
) -> None:
    kv_heads, head_dim = cache.shape[1], cache.shape[4]
    length = seg.end - seg.start
    dev = q.device
    query_pos = torch.arange(seg.prefix_len, seg.prefix_len + length, device=dev)
    if seg.block_ids is None:
        ks, vs = k[:, seg.start : seg.end], v[:, seg.start : seg.end]
        key_pos = query_pos
        allowed = seg.mask if seg.mask is not None else key_pos[None, :] <= query_pos[:, None]
    else:
        blocks = cache.index_select(2, seg.block_ids)
        kv = blocks.view(2, kv_heads, -1, head_dim)[:, :, : seg.mask.shape[-1]]
        ks, vs = kv[0], kv[1]
        key_pos = seg.key_pos if seg.key_pos is not None else torch.arange(ks.shape[1], device=dev)
        allowed = seg.mask
    qg = q[:, seg.start : seg.end].reshape(kv_heads, -1, length, head_dim)[:, None]  # [kvh, 1, g, L, d]
    res = _scores_attention(
        qg, ks[:, None], vs[:, None], allowed[None], scaling, extra, query_pos[None], key_pos[None]
    )
    out[seg.start : seg.end] = res[:, 0].reshape(-1, length, head_dim).transpose(0, 1)


def _decode(
    out: torch.Tensor,
    q: torch.Tensor,
    cache: torch.Tensor,
    group: DecodeGroup,
    scaling: float,
    scratch: torch.Tensor | None,
    extra: _Extras = NO_EXTRAS,
) -> None:
    kv_heads, _, block_size, head_dim = cache.shape[1:]
    num_heads = q.shape[0]
    group_size = num_heads // kv_heads
    rows = group.token_index.numel()
    length = group.num_blocks * block_size
    # [heads, B, d] -> [kv_heads, B, group, d]: a reshape of the query instead of repeating K/V, so the
    # kv heads are SDPA's batch and the requests its heads; each request's keys are its own "head".
    qg = q.index_select(1, group.token_index).view(kv_heads, group_size, rows, head_dim).transpose(1, 2)

    shape = (kv_heads, rows * group.num_blocks, block_size, head_dim)
    numel = kv_heads * rows * length * head_dim
    use_scratch = scratch is not None and scratch.numel() >= 2 * numel
    keys = torch.index_select(
        cache[0], 1, group.block_ids, out=scratch[:numel].view(shape) if use_scratch else None
    )
    values = torch.index_select(
        cache[1], 1, group.block_ids, out=scratch[numel : 2 * numel].view(shape) if use_scratch else None
    )
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


def _record_shape(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, shapes: dict
) -> tuple[torch.Tensor, None]:
    layer = getattr(module, "layer_idx", None)
    if not isinstance(layer, int):
        raise UnsupportedAttentionError(
            "the model's attention modules carry no layer_idx; bm needs one per layer"
        )
    if layer in shapes:
        raise UnsupportedAttentionError(
            f"attention layer {layer} runs twice in one forward (shared KV layers)"
        )
    if value.shape[-1] != key.shape[-1] or query.shape[1] % key.shape[1]:
        raise UnsupportedAttentionError(
            f"layer {layer}: query/key/value shapes {list(query.shape)}, {list(key.shape)}, {list(value.shape)} "
            "are not supported (bm needs equal key and value head sizes and grouped query heads)"
        )
    shapes[layer] = (key.shape[1], key.shape[-1])
    return query.new_zeros(1, query.shape[2], query.shape[1], value.shape[-1]), None


@torch.inference_mode()
def probe_kv_shapes(model: torch.nn.Module) -> dict[int, tuple[int, int]]:
    """Run one token through the model to learn each layer's (kv_heads, head_dim) as it really is.

    Configs name these differently from model to model (and some ignore ``num_key_value_heads``); the
    shapes the attention function receives are the truth. A model that never calls the registered
    function (one that bypasses ``AttentionInterface``) is refused here rather than run wrongly. Models
    with attention classes of their own must be adapted first (:mod:`bm.runtime.adapters`).
    """
    register()
    model.set_attn_implementation(ATTENTION_NAME)
    device = next(model.parameters()).device
    zero = torch.zeros((1, 1), dtype=torch.long, device=device)
    shapes: dict[int, tuple[int, int]] = {}
    meta = AttentionMetadata(kv_caches=[], slot_mapping=zero[0], probe=shapes)
    with batch_metadata(meta):
        model(
            input_ids=zero,
            position_ids=zero,
            use_cache=False,
            logits_to_keep=torch.zeros(1, dtype=torch.long, device=device),
        )
    if not shapes:
        own = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Attention")})
        named = f" (its attention classes: {', '.join(own)})" if own else ""
        raise UnsupportedAttentionError(
            f"{type(model).__name__} computes attention inline{named} instead of through transformers' "
            "AttentionInterface, and bm has no adapter for it, so bm cannot plug its paged attention in"
        )
    return shapes


def _no_mask(*args, **kwargs) -> None:
    """transformers builds no dense mask for bm's packed batches: each sequence is masked inside the kernel."""
    return None


def register() -> str:
    """Register bm's attention (and its no-op mask) under one name; safe to call more than once."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
    return ATTENTION_NAME
