"""The decoder layer's elementwise chains (RMSNorm, add + RMSNorm, SiLU(gate) * up, rotary) as Triton
kernels: what bm.runtime.fusion installs on a CUDA model, in place of the C passes it uses on CPU.

transformers' eager Llama layer runs each chain as several torch kernels (RMSNorm alone: a cast, a
square, a mean, an add, an rsqrt, two multiplies and two casts), each a trip through GPU memory and,
outside a CUDA graph, a launch from Python. On an H200, in a decode step of a 1B Llama shape at 256
requests, those kernels took about 1.2 of 4.8 ms of GPU time; one kernel per chain took the step from
5.92 to 4.36 ms, and SmolLM2's shape from 5.96 to 4.33 ms (docs/gpu.md, "Measured on an H200").

The kernels keep transformers' roundings: every intermediate that torch rounds to the model's dtype
(bfloat16: the normalised row before the weight multiply, SiLU's output, each rotary product) is
rounded here too, so the results differ from transformers' only where the mean's summation order or
``exp``/``rsqrt`` differ in the last bit of float32. Same interface as
:class:`bm.runtime.native.ElementwiseKernels`, which :mod:`bm.runtime.fusion` calls either way.
"""

from __future__ import annotations

import torch

from bm.runtime.kv_quant import NO_SCALES, cache_head_dim, is_quantized
from bm.runtime.native import as_rows, kernel_inputs
from bm.runtime.triton import load_kernels
from bm.runtime.triton.ops import kv_format, next_pow2

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _warps(block: int) -> int:
    return 8 if block >= 4096 else 4


class TritonElementwise:
    """The elementwise chains on ``device_type`` tensors (``cuda``; ``cpu`` under Triton's interpreter)."""

    def __init__(self, device_type: str = "cuda") -> None:
        self.device_type = device_type
        self._k = load_kernels("elementwise_kernels")
        self._no_fma = _no_fma_option()

    def accepts(self, *tensors: torch.Tensor) -> bool:
        """Whether these tensors are ones this object's kernels take (one dtype, no autograd)."""
        return kernel_inputs(tensors, DTYPES, self.device_type)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """transformers' Llama RMSNorm of ``x`` over its last dimension, in ``x``'s dtype."""
        cols = x.shape[-1]
        if weight.shape != (cols,) or not weight.is_contiguous():
            raise ValueError(f"RMSNorm kernel: weight {tuple(weight.shape)} for rows of {cols}")
        rows = as_rows(x)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if rows.shape[0]:
            block = next_pow2(cols)
            self._k.rms_norm_kernel[(rows.shape[0],)](
                rows, rows.stride(0), rows, 0, weight, out, out, cols, float(eps),
                BLOCK=block, ADD=False, num_warps=_warps(block),
            )  # fmt: skip
        return out

    def add_rms_norm(
        self, a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(s, rms_norm(s))`` with ``s = a + b`` rounded to the dtype, as torch's add then the norm."""
        cols = a.shape[-1]
        if a.shape != b.shape or weight.shape != (cols,) or not weight.is_contiguous():
            raise ValueError(
                f"add-RMSNorm kernel: a {tuple(a.shape)}, b {tuple(b.shape)}, weight {tuple(weight.shape)}"
            )
        ra, rb = as_rows(a), as_rows(b)
        s = torch.empty(a.shape, dtype=a.dtype, device=a.device)
        out = torch.empty_like(s)
        if ra.shape[0]:
            block = next_pow2(cols)
            self._k.rms_norm_kernel[(ra.shape[0],)](
                ra, ra.stride(0), rb, rb.stride(0), weight, s, out, cols, float(eps),
                BLOCK=block, ADD=True, num_warps=_warps(block),
            )  # fmt: skip
        return s, out

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` in the dtype, same shapes."""
        if gate.shape != up.shape:
            raise ValueError(f"SiLU-mul kernel: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
        g, u = as_rows(gate), as_rows(up)
        out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        cols = g.shape[1]
        if g.shape[0] and cols:
            block = min(1024, next_pow2(cols))
            grid = (g.shape[0], -(-cols // block))
            self._k.silu_mul_kernel[grid](g, g.stride(0), u, u.stride(0), out, cols, BLOCK=block)
        return out

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x * cos + rotate_half(x) * sin`` for ``x`` [tokens, heads, d] and ``cos``/``sin`` [tokens, d];
        returns a contiguous [tokens, heads, d] in ``x``'s dtype."""
        x, out = _rotary_operand(x, cos, sin)
        tokens, heads, d = x.shape
        if tokens:
            self._k.rotary_kernel[(tokens,)](
                x, x.stride(0), x.stride(1), cos.contiguous(), sin.contiguous(), out, heads,
                HEAD_DIM=d, HEAD_PAD=next_pow2(d), BLOCK_H=next_pow2(heads), **self._no_fma,
            )  # fmt: skip
        return out

    def rotary_pair(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`rotary` of ``q`` [tokens, q_heads, d] and ``k`` [tokens, k_heads, d] in one launch, the
        same bits as two calls."""
        (q, q_out), (k, k_out) = _rotary_operand(q, cos, sin), _rotary_operand(k, cos, sin)
        tokens, q_heads, d = q.shape
        if tokens:
            self._k.rotary_pair_kernel[(tokens, 2)](
                q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), cos.contiguous(), sin.contiguous(),
                q_out, k_out, q_heads, k.shape[1], HEAD_DIM=d, HEAD_PAD=next_pow2(d),
                BLOCK_HQ=next_pow2(q_heads), BLOCK_HK=next_pow2(k.shape[1]), **self._no_fma,
            )  # fmt: skip
        return q_out, k_out

    def rotary_store_kv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scales: tuple[float, float] = NO_SCALES,
    ) -> torch.Tensor:
        """:meth:`rotary` of the queries ``q`` [tokens, q_heads, d], returned, with the rotated keys ``k``
        and the values ``v`` [tokens, kv_heads, d] written into ``cache`` (one layer's
        ``[2, kv_heads, blocks, tokens_per_block, d]``, in ``q``'s dtype, or quantized rows of ``d``
        values: bm.runtime.kv_quant, ``kv_scales`` an fp8 layer's) at ``slot_mapping`` [tokens] (int32;
        -1: not stored), in one launch. The queries and the cache get the bits :meth:`rotary_pair` then
        the attention kernels' KV store give them."""
        (q, q_out), (k, _) = _rotary_operand(q, cos, sin), _rotary_operand(k, cos, sin, output=False)
        tokens, q_heads, d = q.shape
        kv_heads = k.shape[1]
        if (
            v.shape != k.shape
            or (cache.dtype != q.dtype and not is_quantized(cache))
            or cache.shape[:2] != (2, kv_heads)
            or cache_head_dim(cache) != d
            or slot_mapping.shape != (tokens,)
        ):
            raise ValueError(
                f"rotary KV-store kernel: k {tuple(k.shape)}, v {tuple(v.shape)}, cache "
                f"{tuple(cache.shape)} {cache.dtype} for {q.dtype}, slots {tuple(slot_mapping.shape)}"
            )
        v = v if v.stride(2) == 1 else v.contiguous()
        if tokens:
            self._k.rotary_store_kv_kernel[(tokens, 2)](
                q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
                cos.contiguous(), sin.contiguous(), q_out, cache[0], cache[1], slot_mapping,
                cache.stride(1), cache.stride(2), cache.stride(3), q_heads, kv_heads,
                float(kv_scales[0]), float(kv_scales[1]),
                TOKENS_PER_BLOCK=cache.shape[3], HEAD_DIM=d, HEAD_PAD=next_pow2(d),
                BLOCK_HQ=next_pow2(q_heads), BLOCK_HK=next_pow2(kv_heads),
                KV_QUANT=kv_format(cache), **self._no_fma,
            )  # fmt: skip
        return q_out


def _rotary_operand(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, output: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` [tokens, heads, d] checked against ``cos``/``sin`` [tokens, d], with unit stride along ``d``
    as the rotary kernels read it, and the output it gets (None with ``output=False``: written elsewhere)."""
    tokens, heads, d = x.shape
    if d % 2 or cos.shape != (tokens, d) or sin.shape != (tokens, d):
        raise ValueError(f"rotary kernel: x {tuple(x.shape)} with cos {tuple(cos.shape)}")
    x = x if x.stride(2) == 1 else x.contiguous()
    return x, torch.empty(tokens, heads, d, dtype=x.dtype, device=x.device) if output else None


def _no_fma_option() -> dict[str, bool]:
    """Compiled kernels take compile options as launch arguments: no multiply-add contraction, so each
    product is rounded before the sum as torch rounds it. The interpreter has no such option (and rounds
    each operation on its own anyway)."""
    import triton

    return {} if triton.knobs.runtime.interpret else {"enable_fp_fusion": False}
