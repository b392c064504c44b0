"""Causal attention of a context chunk, flash-attention style (``prefill_attention.c``)."""

from __future__ import annotations

import ctypes

import torch

from bm.runtime.kv_quant import FP8, NO_SCALES, cache_head_dim
from bm.runtime.native.args import BF16, F32, FLOAT, I64, INT, PTR, bind, pointer, require, unit_stride
from bm.runtime.native.loader import NativeKernel, load_kernel

_NAME = "prefill attention kernel"
_ARGS = (PTR, INT, INT, PTR, PTR, INT, INT, PTR, PTR, PTR, INT, INT, PTR, *[INT] * 6, FLOAT, INT, INT)
_KVQ = {torch.int8: 2, FP8: 3}  # a quantized cache's dtype -> the kernel's kq flag


class PrefillAttentionKernel(NativeKernel):
    """Causal attention of one context chunk's queries to its own keys, or to a cached prefix read by
    block table plus its own keys (flash-attention style, AVX-512 or AVX2/FMA register tiles; plain C
    in the scalar build).

    At SmolLM2-135M's shape (head size 64, 9 query heads over 3 kv heads, two threads) 1.6-2.2x torch's
    CPU flash attention on whole prompts of 64-1024 tokens (up to 79% of the 2048^3 matmul peak, against
    SDPA's 50%), 1.4-1.5x after a cached prefix: ``benchmarks/prefill_attention.py``.

    The AVX-512 build also takes bf16 queries, keys, values, cache and output (``dtypes``), widened as
    they are packed: exactly the float32 kernel's result on the widened inputs, rounded to bf16. Every
    build reads a quantized cache (int8 or fp8 rows, ``bm.runtime.kv_quant``) after a cached prefix with
    float32 queries, dequantized as it is packed: exactly the float32 kernel's result on the dequantized
    cache.
    """

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = {F32: bind(lib, "bm_prefill_attention_f32", *_ARGS)}
        if hasattr(lib, "bm_prefill_attention_bf16"):
            self._fn[BF16] = bind(lib, "bm_prefill_attention_bf16", *_ARGS)
        self._kvq = bind(lib, "bm_prefill_attention_kvq", *_ARGS, INT, FLOAT, FLOAT)
        self.dtypes: tuple[torch.dtype, ...] = tuple(self._fn)
        self.vectorized = bool(lib.bm_prefill_attention_vectorized())

    @staticmethod
    def handles(device: torch.device, dtype: torch.dtype) -> bool:
        """Whether some build attends ``dtype`` on ``device`` (float32 all, bf16 AVX-512's)."""
        return device.type == "cpu" and dtype in (F32, BF16)

    def __call__(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        start: int,
        end: int,
        scaling: float,
        cache: torch.Tensor | None = None,
        block_table: torch.Tensor | None = None,
        prefix_len: int = 0,
        vectorize: bool = True,
        kv_scales: tuple[float, float] = NO_SCALES,
    ) -> None:
        """Writes ``out[start:end]`` for the chunk of query tokens ``[start, end)`` of the packed batch.

        ``out`` [tokens, heads, d] contiguous; ``q`` [heads, tokens, d]; ``k``/``v`` [kv_heads, tokens, d]
        (any token and head strides, unit stride within a head). Without ``block_table`` the chunk is a
        whole prompt (``prefix_len`` 0) attending its own keys ``k``/``v[:, start:end]``; with it, its query
        tokens sit at positions ``prefix_len ..`` and every key, the chunk's own included, is read from
        ``cache`` (one layer's [2, kv_heads, num_blocks, block_size, d]) through ``block_table``, the
        request's first blocks in order. ``vectorize=False`` runs the plain C loops (for tests). Every
        tensor is float32, or every one bf16 where the build takes it (``dtypes``); or, with a block
        table, the cache int8 or fp8 and the rest float32, an fp8 cache's keys scaled by
        ``kv_scales[0]`` and its values by ``kv_scales[1]``."""
        heads, _, head_dim = q.shape
        kv_heads = k.shape[0]
        length = end - start
        dtype = q.dtype
        fn = self._fn.get(dtype)
        if fn is None:
            raise ValueError(
                f"{_NAME}: this build ({self.isa}) takes {', '.join(map(str, self.dtypes))}, not {dtype}"
            )
        require(_NAME, dtype, (out, q, k, v), (out,))
        if (
            heads % kv_heads
            or out.shape[1:] != (heads, head_dim)
            or k.shape[::2] != (kv_heads, head_dim)
            or v.shape != k.shape
            or not 0 <= start <= end <= min(out.shape[0], q.shape[1], k.shape[1])
        ):
            raise ValueError(
                f"{_NAME}: out {tuple(out.shape)}, q {tuple(q.shape)}, k {tuple(k.shape)}, "
                f"v {tuple(v.shape)} and tokens [{start}, {end}) disagree"
            )
        q = unit_stride(q)
        if k.stride(2) != 1 or v.stride(2) != 1 or k.stride() != v.stride():
            k, v = k.contiguous(), v.contiguous()
        blocks = block_size = kq = 0
        if block_table is not None:
            if cache is None:
                raise ValueError(f"{_NAME}: a block table needs the contiguous cache")
            kq = _KVQ.get(cache.dtype, 0)
            if kq:
                require(_NAME, F32, (q,))
            require(_NAME, cache.dtype if kq else dtype, (cache,), (cache,))
            require(_NAME, I64, (block_table,), (block_table,))
            if cache.shape[1] != kv_heads or cache_head_dim(cache) != head_dim:
                raise ValueError(f"{_NAME}: cache {tuple(cache.shape)} against k {tuple(k.shape)}")
            blocks, block_size = cache.shape[2], cache.shape[3]
            if block_table.numel() * block_size < prefix_len + length:
                raise ValueError(
                    f"{_NAME}: the block table must be contiguous int64 covering all {prefix_len + length} keys"
                )
        elif prefix_len:
            raise ValueError(f"{_NAME}: a cached prefix is read through a block table")
        halves = (None, None) if block_table is None else (cache[0].data_ptr(), cache[1].data_ptr())
        size = q.element_size()
        common = (
            q.data_ptr() + start * q.stride(1) * size, q.stride(1), q.stride(0),
            k.data_ptr() + start * k.stride(1) * size, v.data_ptr() + start * v.stride(1) * size,
            k.stride(1), k.stride(0), *halves, pointer(block_table), blocks, block_size,
            out.data_ptr() + start * out.stride(0) * size, out.stride(0),
            length, prefix_len, heads, kv_heads, head_dim, scaling, torch.get_num_threads(), int(vectorize),
        )  # fmt: skip
        status = self._kvq(*common, kq, *kv_scales) if kq else fn(*common)
        if status:
            raise MemoryError("prefill attention: no memory for the packed keys or a thread's tile")


def prefill_attention_kernel(isa: str | None = None) -> PrefillAttentionKernel | None:
    """The compiled prefill attention kernel, or None (see :func:`bm.runtime.native.loader.load_kernel`)."""
    return load_kernel("prefill_attention", PrefillAttentionKernel, isa)
