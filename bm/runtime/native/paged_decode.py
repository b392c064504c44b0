"""Decode attention over paged KV blocks read in place (``paged_decode.c``), and the KV write beside it."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from bm.runtime.attention import NO_EXTRAS, LayerExtras
from bm.runtime.kv_quant import FP8, NO_SCALES, SCALE_BYTES
from bm.runtime.native.args import BF16, F32, FLOAT, I64, INT, PTR, bind, fits, pointer, require, unit_stride
from bm.runtime.native.loader import NativeKernel, load_kernel

_NAME = "paged decode kernel"
I8 = torch.int8


@dataclass(frozen=True)
class DecodeRows:
    """A forward's decode rows as the kernel reads them: checked once when built, so each layer's call
    passes them on as they are."""

    token_index: torch.Tensor  # [rows] int64: each row's query in the packed batch (rows of q and out)
    block_table: torch.Tensor  # [rows, max_blocks] int64, each row padded past its length (never read)
    lengths: torch.Tensor  # [rows] int64: keys each row attends (its position + 1)
    max_len: int
    window: int | None = None  # each row attends only its last ``window`` keys; blocks before are never read

    def __post_init__(self) -> None:
        index = (self.token_index, self.block_table, self.lengths)
        require(_NAME, I64, index, index)
        if (
            self.block_table.dim() != 2
            or not self.token_index.shape == self.lengths.shape == self.block_table.shape[:1]
        ):
            raise ValueError(
                f"{_NAME}: token index {tuple(self.token_index.shape)}, block table "
                f"{tuple(self.block_table.shape)} and lengths {tuple(self.lengths.shape)} disagree on rows"
            )


_ATTEND = (
    PTR,
    INT,
    INT,
    PTR,
    PTR,
    PTR,
    PTR,
    PTR,
    PTR,
    *[INT] * 8,
    FLOAT,
    FLOAT,
    PTR,
    INT,
    PTR,
    FLOAT,
    FLOAT,
    INT,
)
_WRITE = (PTR, INT, INT, PTR, INT, INT, PTR, PTR, PTR, *[INT] * 5)


class PagedDecodeKernel(NativeKernel):
    """Single-token queries attending their own KV blocks, read in place (no gather).

    A float32 cache everywhere; a bf16 cache (bf16 queries and output) where the build has the bf16
    kernel, the AVX-512 one (``dtypes``): it widens keys and values in registers and computes exactly what
    the float32 kernel computes on the widened values, reading half the bytes."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = {F32: bind(lib, "bm_paged_decode_f32", *_ATTEND)}
        # quantized caches (kv_cache.dtype: int8 | fp8_e4m3, bm.runtime.kv_quant): float32 queries and output
        self._quantized = {
            dtype: bind(lib, name, *_ATTEND)
            for dtype, name in ((I8, "bm_paged_decode_i8"), (FP8, "bm_paged_decode_f8"))
            if hasattr(lib, name)
        }
        self._write = {F32: bind(lib, "bm_kv_write_f32", *_WRITE)}
        if hasattr(lib, "bm_paged_decode_bf16"):
            self._fn[BF16] = bind(lib, "bm_paged_decode_bf16", *_ATTEND)
            self._write[BF16] = bind(lib, "bm_kv_write_bf16", *_WRITE)
        self.dtypes: tuple[torch.dtype, ...] = tuple(self._fn)

    @staticmethod
    def handles(device: torch.device, dtype: torch.dtype) -> bool:
        """Whether some build reads a cache of ``dtype`` on ``device`` (float32 all, bf16 AVX-512's)."""
        return device.type == "cpu" and dtype in (F32, BF16)

    def supports(self, cache: torch.Tensor) -> bool:
        """Whether this build reads ``cache`` in place (a quantized cache: with float32 queries)."""
        known = cache.dtype in self._fn or cache.dtype in self._quantized
        return cache.device.type == "cpu" and known and cache.is_contiguous()

    def write_kv(self, cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Copy keys ``k`` and values ``v`` [kv_heads, T, d] (any strides, unit along d) into ``cache``'s
        flat slots ``slots`` [T] int64, as ``index_copy_`` along the slot dimension does; False (nothing
        written) where the tensors do not fit the kernel, so the caller copies with torch instead."""
        _, kv_heads, num_blocks, block_size, d = cache.shape
        write = self._write.get(cache.dtype)
        if not (
            write is not None
            and fits(cache.dtype, (k, v, cache), (cache,))
            and fits(I64, (slots,), (slots,))
            and k.shape == v.shape == (kv_heads, slots.shape[0], d)
            and k.stride(2) == 1
            and v.stride(2) == 1
        ):
            return False
        base = cache.data_ptr()
        status = write(
            k.data_ptr(), k.stride(1), k.stride(0), v.data_ptr(), v.stride(1), v.stride(0), base,
            base + cache.element_size() * cache.stride(0), slots.data_ptr(), slots.shape[0], kv_heads, num_blocks * block_size, d,
            torch.get_num_threads(),
        )  # fmt: skip
        if status:
            raise IndexError("KV write: a slot lies outside the cache")
        return True

    def __call__(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        cache: torch.Tensor,
        rows: DecodeRows,
        scaling: float,
        extras: LayerExtras = NO_EXTRAS,
        kv_scales: tuple[float, float] = NO_SCALES,
    ) -> None:
        """``out`` [tokens, heads, d] contiguous; ``q`` [heads, tokens, d]; ``cache`` one layer's
        [2, kv_heads, num_blocks, block_size, d]; ``rows``: which rows of ``q``/``out`` attend which blocks.
        ``extras``: the layer's soft-capping (scores become ``softcap * tanh(score / softcap)``), ALiBi
        slopes ([heads] float32: ``slope * (key - query)`` is added to each score) and sink logits ([heads]
        float32: one more logit per head in the softmax's denominator, gpt-oss). ``q``, ``out`` and
        ``cache`` are float32, or all bf16 where the build reads bf16 (``dtypes``); or ``q`` and ``out``
        float32 over an int8 or fp8 cache, an fp8 one's keys scaled by ``kv_scales[0]`` and its values
        by ``kv_scales[1]``."""
        q = unit_stride(q)
        heads, _, head_dim = q.shape
        _, kv_heads, num_blocks, block_size, cache_dim = cache.shape
        alibi, sinks = extras.alibi, extras.sinks
        if cache.dtype in self._quantized:  # int8: rows of head_dim values, then their scale
            fn, cache_dim = (
                self._quantized[cache.dtype],
                cache_dim - (SCALE_BYTES if cache.dtype == I8 else 0),
            )
            require(_NAME, F32, (q, out), (out,))
            require(_NAME, cache.dtype, (cache,), (cache,))
        else:
            fn = self._fn.get(cache.dtype)
            if fn is None:
                raise ValueError(
                    f"{_NAME}: this build ({self.isa}) reads {', '.join(map(str, self.dtypes))} caches, not {cache.dtype}"
                )
            require(_NAME, cache.dtype, (q, out, cache), (out, cache))
        require(_NAME, F32, (alibi, sinks), (alibi, sinks))
        if head_dim != cache_dim or heads % kv_heads or out.shape[1:] != (heads, head_dim):
            raise ValueError(
                f"{_NAME}: q {tuple(q.shape)}, out {tuple(out.shape)} and cache "
                f"{tuple(cache.shape)} disagree on heads or head size"
            )
        if (alibi is not None and alibi.shape != (heads,)) or (sinks is not None and sinks.shape != (heads,)):
            raise ValueError(f"{_NAME}: ALiBi slopes and sink logits must be {heads} values, one a head")
        num_rows, max_blocks = rows.block_table.shape
        status = fn(
            q.data_ptr(), q.stride(1), q.stride(0), cache[0].data_ptr(), cache[1].data_ptr(),
            rows.token_index.data_ptr(), rows.block_table.data_ptr(), rows.lengths.data_ptr(), out.data_ptr(),
            num_rows, max_blocks, heads, kv_heads, num_blocks, block_size, head_dim, rows.max_len,
            scaling, extras.softcap or 0.0, pointer(alibi), rows.window or 0, pointer(sinks), *kv_scales,
            torch.get_num_threads(),
        )  # fmt: skip
        if status:
            raise MemoryError("paged decode attention: no memory for a thread's scratch buffer")


def paged_decode_kernel(isa: str | None = None) -> PagedDecodeKernel | None:
    """The compiled decode attention kernel, or None (see :func:`bm.runtime.native.loader.load_kernel`)."""
    return load_kernel("paged_decode", PagedDecodeKernel, isa)
