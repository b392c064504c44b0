"""Launching the Triton kernels: tile sizes, grids, and the per-layer extras (soft-cap, ALiBi, sinks).

:func:`paged_attention` computes what bm's torch reference path computes for the same batch (see
``bm/runtime/attention.py``), for every feature bm supports: GQA, attention windows with sink tokens,
Gemma 2's soft-capping, ALiBi slopes and gpt-oss's per-head sink logits. A decode-only batch whose
sequences x KV heads are too few to fill the GPU runs the split-KV kernel pair instead of the
single-pass kernel (:func:`choose_decode_split`); both serve every one of those features.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from bm.runtime.kv_quant import FP8, NO_SCALES
from bm.runtime.triton import load_kernels
from bm.runtime.triton.batch import PagedBatch, cdiv

# The largest head size the kernel takes; larger heads go to the torch path (docs/gpu.md).
MAX_HEAD_DIM = 256


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1): Triton's tile extents must be powers of two."""
    return 1 << (n - 1).bit_length()


def supports_head_dim(head_dim: int) -> bool:
    return head_dim <= MAX_HEAD_DIM


def key_tile(head_dim: int) -> int:
    """Keys per tile of the attention kernels: 64, or 32 for heads over 128 (a key and a value tile of
    ``tile x head`` elements each stay within one program's registers and shared memory)."""
    return 64 if head_dim <= 128 else 32


# Split-KV decode (flash-decoding). Issue 40 measured the single-pass kernel's decode step on an H100
# (132 SMs, 256 sequences x 512 tokens): 768 programs (SmolLM2's 3 KV heads, 5.8 per SM) read KV at 61%
# of the copy bandwidth, 2,048 (a 1B Llama's 8, 15.5 per SM) at 78%. A decode batch below FILL_PER_SM
# programs per SM (between the two) is split until it reaches it: SmolLM2's step becomes 3 x 768,
# the 1B shape's stays as measured. Neither number is measured with the split kernel yet (docs/gpu.md).
FILL_PER_SM = 12
MAX_SPLITS = 16  # pass 2 merges at most this many partials per head (one tile of its registers)
MIN_SPLIT_TILES = 2  # key tiles per split at least: a split's query load and partial amortised over them
NOMINAL_SM_COUNT = 132  # an H100 SXM's: what the choice assumes off CUDA (Triton's interpreter, tests)


# Launch options of the decode kernels, from a sweep on an H100 (benchmarks/decode_attention_peers.py,
# 256 sequences x 512 keys, bf16, 16-token blocks, CUDA-graph replays of one layer): against Triton's
# defaults (4 warps, 3 stages), the single-pass kernel took 0.968x the time with 2 stages on the 1B
# shape, and split-KV pass 1 0.91x with 2 warps and 1 stage on SmolLM2's. Prompts keep the defaults.
DECODE_LAUNCH = {"num_warps": 4, "num_stages": 2}
SPLIT_LAUNCH = {"num_warps": 2, "num_stages": 1}


@dataclass(frozen=True)
class DecodeSplit:
    """How a decode-only batch's attention runs: ``num_splits`` programs per (sequence, KV head), each
    walking its share of the keys in tiles of ``block_n`` (1: the single-pass kernel)."""

    num_splits: int
    block_n: int


def device_sm_count(device: torch.device) -> int:
    """The streaming multiprocessors the split choice fills: the device's own on CUDA, else
    :data:`NOMINAL_SM_COUNT` (so the interpreter, on CPU, chooses what an H100 would)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return NOMINAL_SM_COUNT


def choose_decode_split(
    num_seqs: int,
    kv_heads: int,
    head_dim: int,
    max_context: int,
    sm_count: int = NOMINAL_SM_COUNT,
    block_n: int | None = None,
) -> DecodeSplit:
    """The split of a decode-only batch of ``num_seqs`` rows whose longest sequence may reach
    ``max_context`` keys: one split (the single-pass kernel) where ``num_seqs x kv_heads`` programs
    already fill the device or no sequence has keys for two splits; else the fewest splits that reach
    ``FILL_PER_SM x sm_count`` programs, at most :data:`MAX_SPLITS`.

    The count depends on the context only through that yes/no: how many splits a sequence actually
    uses is decided in the kernel from its own length (at least :data:`MIN_SPLIT_TILES` tiles each),
    so a CUDA graph captured for ``max_context`` = the static table's capacity computes, for every
    later context, what an eager step with the same rows computes. The tile comes from the head size
    alone (:func:`key_tile`), for the same reason."""
    tile = block_n or key_tile(head_dim)
    programs = num_seqs * kv_heads
    target = FILL_PER_SM * sm_count
    if programs >= target or cdiv(max_context, tile) <= MIN_SPLIT_TILES:
        return DecodeSplit(1, tile)
    return DecodeSplit(min(MAX_SPLITS, cdiv(target, programs)), tile)


def decode_split(
    batch: PagedBatch, kv_heads: int, head_dim: int, sm_count: int, block_n: int | None = None
) -> DecodeSplit:
    """:func:`choose_decode_split` for a batch: decode-only batches (one query per sequence) only; any
    batch with a prompt or a chunk runs the single-pass kernel, whose programs already span the
    prompt's queries."""
    if batch.max_query_len != 1 or batch.num_tokens != batch.num_seqs:
        return DecodeSplit(1, block_n or key_tile(head_dim))
    return choose_decode_split(batch.num_seqs, kv_heads, head_dim, batch.max_seq_len, sm_count, block_n)


class SplitScratch:
    """Pass 1's partials (per row, head and split: ``head_dim`` accumulator values, a max and a sum, in
    float32), in one buffer that grows and is never freed while its owner lives.

    A CUDA graph keeps the addresses it was captured with: a smaller buffer replaced by a larger one
    stays referenced here (``_buffers``), so a graph captured over it never replays into memory handed
    to someone else. Growth doubles, so a run allocates a few times at most (during warm-up, where
    every decode bucket runs once before it is captured). Layers reuse the buffer: pass 2 of one layer
    reads it before pass 1 of the next writes it, in stream order."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: list[torch.Tensor] = []

    @property
    def nbytes(self) -> int:
        """Bytes held, retired buffers included (0 until a split-KV step first runs)."""
        return sum(b.numel() * b.element_size() for b in self._buffers)

    def take(self, rows: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views ``acc [rows * head_dim]``, ``max [rows]``, ``sum [rows]``, each 64-byte aligned."""
        acc_end = _align16(rows * head_dim)
        max_end = acc_end + _align16(rows)
        need = max_end + rows
        if not self._buffers or self._buffers[-1].numel() < need:
            size = max(need, 2 * self._buffers[-1].numel()) if self._buffers else need
            self._buffers.append(torch.empty(size, dtype=torch.float32, device=self.device))
        buf = self._buffers[-1]
        return buf[: rows * head_dim], buf[acc_end : acc_end + rows], buf[max_end:need]


def _align16(n: int) -> int:
    return -(-n // 16) * 16


def kv_format(cache: torch.Tensor) -> int:
    """The kernels' KV_QUANT for a layer's cache: full width, int8 rows or fp8 (bm.runtime.kv_quant)."""
    return _kv_format_of(cache.dtype)


@cache
def _kv_format_of(dtype: torch.dtype) -> int:
    """Per dtype, once (every launch asks): kv_rows imports triton, so it is read when kernels first run."""
    from bm.runtime.triton.kv_rows import KV_FP8, KV_FULL, KV_INT8

    return {torch.int8: KV_INT8, FP8: KV_FP8}.get(dtype, KV_FULL)


def store_kv(
    cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: tuple[float, float] = NO_SCALES,
) -> None:
    """Write ``key``/``value`` ``[kv_heads, T, d]`` into ``cache`` at ``slot_mapping`` (one launch), as its
    rows are stored: a quantized cache's quantized in the kernel (``kv_scales``: an fp8 layer's key and
    value scales). Each keeps its own strides: values split from a stacked q/k/v product
    (bm.runtime.fused_projections) step by its width, keys out of the rotary kernel by theirs; making
    both contiguous would copy them per layer."""
    kernels = load_kernels()
    kv_heads, num_tokens, head_dim = key.shape
    if num_tokens == 0:
        return
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    kernels.store_kv_kernel[(num_tokens, kv_heads)](
        key, value, cache[0], cache[1], slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        cache.stride(1), cache.stride(2), cache.stride(3), float(kv_scales[0]), float(kv_scales[1]),
        TOKENS_PER_BLOCK=cache.shape[3], HEAD_DIM=head_dim, HEAD_PAD=next_pow2(head_dim),
        KV_QUANT=kv_format(cache),
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
    num_splits: int | None = None,
    sm_count: int | None = None,
    scratch: SplitScratch | None = None,
    launch: dict[str, int] | None = None,
    kv_scales: tuple[float, float] = NO_SCALES,
) -> None:
    """Attention of every query ``q [heads, T, d]`` to its sequence's cached keys, into ``out [T, heads, d]``.
    A quantized cache's rows are widened to ``q``'s dtype as they are read (``kv_scales``: an fp8
    layer's key and value scales).

    ``alibi``/``sinks``: ``[heads]`` float32 slopes / sink logits. One launch for the whole batch, or
    two for a decode-only batch that runs split-KV: ``num_splits`` forces a split count (1: the
    single-pass kernel; more: decode-only batches only), else :func:`decode_split` chooses it for
    ``sm_count`` SMs (default: the device's, :func:`device_sm_count`). ``block_n``: keys per tile
    (default :func:`key_tile`). ``scratch``: the split partials' buffer to reuse (one is made for the
    call without it; a backend keeps one, for its CUDA graphs). ``launch``: Triton launch options for
    the attention kernel (``num_warps``, ``num_stages``; pass 1's under split-KV), for a tuning sweep
    (benchmarks/decode_attention_peers.py); None: :data:`DECODE_LAUNCH` / :data:`SPLIT_LAUNCH` for a
    decode-only batch, Triton's defaults otherwise.
    """
    kernels = load_kernels()
    num_heads, num_tokens, head_dim = q.shape
    if num_tokens == 0:
        return
    kv_heads, tokens_per_block = cache.shape[1], cache.shape[3]
    if num_splits is None:
        sm = sm_count if sm_count is not None else device_sm_count(q.device)
        split = decode_split(batch, kv_heads, head_dim, sm, block_n)
        num_splits, block_n = split.num_splits, split.block_n
    if block_n is None:
        block_n = key_tile(head_dim)
    q = _last_dim_contiguous(q)
    if num_splits > 1:
        if batch.max_query_len != 1 or num_tokens != batch.num_seqs:
            raise ValueError("split-KV attention serves decode-only batches (one query per sequence)")
        _split_kv_decode(
            kernels, out, q, cache, batch, scale, softcap, alibi, sinks, num_splits, block_n,
            scratch if scratch is not None else SplitScratch(q.device),
            SPLIT_LAUNCH if launch is None else launch, kv_scales,
        )  # fmt: skip
        return
    if launch is None:
        launch = DECODE_LAUNCH if batch.max_query_len == 1 else {}
    group = num_heads // kv_heads
    # 16 query rows (a tensor-core tile) per program for decode; 64 when prompts are in the batch so a
    # long prompt's keys are read by fewer programs.
    block_m = max(16 if batch.max_query_len == 1 else 64, next_pow2(group))
    block_q = max(1, block_m // group)
    dummy = cache  # unused pointer arguments (the feature flags keep the kernel from reading them)
    window = batch.window
    grid = (num_tokens // block_q + batch.num_seqs, kv_heads)
    kernels.paged_attention_kernel[grid](
        out, q, cache[0], cache[1], batch.block_table, batch.seq_lens, batch.cu_seqlens,
        sinks if sinks is not None else dummy, alibi if alibi is not None else dummy,
        float(scale), float(softcap or 0.0), int(window or 0), int(batch.sink_tokens),
        float(kv_scales[0]), float(kv_scales[1]), batch.num_seqs,
        batch.block_table.stride(0), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        cache.stride(1), cache.stride(2), cache.stride(3),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        HEAD_DIM=head_dim, HEAD_PAD=max(16, next_pow2(head_dim)), TOKENS_PER_BLOCK=tokens_per_block,
        USE_SOFTCAP=softcap is not None, USE_ALIBI=alibi is not None, USE_SINKS=sinks is not None,
        USE_WINDOW=window is not None, DOT=dot_mode(q.dtype), KV_QUANT=kv_format(cache),
        **launch,
    )  # fmt: skip


def _split_kv_decode(
    kernels,
    out: torch.Tensor,
    q: torch.Tensor,
    cache: torch.Tensor,
    batch: PagedBatch,
    scale: float,
    softcap: float | None,
    alibi: torch.Tensor | None,
    sinks: torch.Tensor | None,
    num_splits: int,
    block_n: int,
    scratch: SplitScratch,
    launch: dict[str, int],
    kv_scales: tuple[float, float],
) -> None:
    """Pass 1 over ``(sequence, KV head, split)``, pass 2 over ``(sequence, query head)``: both grids are
    functions of the row count and the split count alone, as a CUDA graph needs."""
    num_heads, num_seqs, head_dim = q.shape
    kv_heads, tokens_per_block = cache.shape[1], cache.shape[3]
    group = num_heads // kv_heads
    head_pad = max(16, next_pow2(head_dim))
    part_acc, part_max, part_sum = scratch.take(num_seqs * num_heads * num_splits, head_dim)
    window, sink_tokens = int(batch.window or 0), int(batch.sink_tokens)
    use_window = batch.window is not None
    dummy = cache  # unused pointer arguments (the feature flags keep the kernels from reading them)
    kernels.split_kv_decode_kernel[(num_seqs, kv_heads, num_splits)](
        part_acc, part_max, part_sum, q, cache[0], cache[1], batch.block_table, batch.seq_lens,
        alibi if alibi is not None else dummy,
        float(scale), float(softcap or 0.0), window, sink_tokens, float(kv_scales[0]), float(kv_scales[1]),
        num_splits, batch.block_table.stride(0), q.stride(0), q.stride(1), cache.stride(1), cache.stride(2), cache.stride(3),
        GROUP=group, BLOCK_M=max(16, next_pow2(group)), BLOCK_N=block_n, MIN_TILES=MIN_SPLIT_TILES,
        HEAD_DIM=head_dim, HEAD_PAD=head_pad, TOKENS_PER_BLOCK=tokens_per_block,
        USE_SOFTCAP=softcap is not None, USE_ALIBI=alibi is not None, USE_WINDOW=use_window,
        DOT=dot_mode(q.dtype), KV_QUANT=kv_format(cache), **launch,
    )  # fmt: skip
    kernels.split_kv_combine_kernel[(num_seqs, num_heads)](
        out, part_acc, part_max, part_sum, batch.seq_lens, sinks if sinks is not None else dummy,
        window, sink_tokens, num_splits, out.stride(0), out.stride(1),
        BLOCK_N=block_n, SPLITS_PAD=next_pow2(num_splits), MIN_TILES=MIN_SPLIT_TILES,
        HEAD_DIM=head_dim, HEAD_PAD=head_pad, USE_SINKS=sinks is not None, USE_WINDOW=use_window,
    )  # fmt: skip


def dot_mode(dtype: torch.dtype) -> int:
    """The DOT a kernel runs for operands of ``dtype`` (bm.runtime.triton.dots): IEEE for float32 (the
    oracle's), the tensor cores' otherwise, widened to float32 in the interpreter (its bf16 dot is wrong)."""
    import triton

    from bm.runtime.triton import dots

    if dtype == torch.float32:
        return dots.DOT_IEEE
    return dots.DOT_UPCAST if triton.knobs.runtime.interpret else dots.DOT_FAST


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
