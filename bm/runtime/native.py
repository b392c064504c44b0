"""Optional C kernels, compiled from source at first use with the machine's C compiler.

Each kernel is built for the instruction set :mod:`bm.cpu_isa` picks from the CPU's features
(AVX-512, AVX2 or scalar; ``BM_CPU_ISA`` caps it) and cached per machine (bm.runtime.native_build).
Where nothing can be built (no compiler, an unusual platform, or ``BM_NATIVE_KERNELS=0`` in the
environment), bm runs its torch implementation of the same computation, which gives the same results up
to float rounding; tests pin that the two agree, for every variant the machine runs.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bm.cpu_isa import KERNEL_ISAS, kernel_isa
from bm.runtime.native_build import compile_kernel

ENV_SWITCH = "BM_NATIVE_KERNELS"
_SOURCE = Path(__file__).parent / "native" / "paged_decode.c"
_GEMM_SOURCE = Path(__file__).parent / "native" / "small_gemm.c"
_PREFILL_SOURCE = Path(__file__).parent / "native" / "prefill_attention.c"
_LORA_SOURCE = Path(__file__).parent / "native" / "lora_delta.c"
_ELEMENTWISE_SOURCE = Path(__file__).parent / "native" / "elementwise.c"
PANEL = 16  # output columns per packed weight panel in small_gemm.c

_lock = threading.Lock()
_loaded: dict[tuple[str, str], object] = {}


class NativeKernel:
    """A compiled kernel's wrapper; ``isa`` names the variant it was built for (bm.cpu_isa)."""

    isa: str = ""


def native_kernels_enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


class PagedDecodeKernel(NativeKernel):
    """Single-token queries attending their own KV blocks, read in place (no gather)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.bm_paged_decode_f32
        fn.restype = ctypes.c_int
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr]
        fn.argtypes += [i64] * 8 + [ctypes.c_float, ctypes.c_float, ptr, i64, ptr, i64]
        self._fn = fn
        write = lib.bm_kv_write_f32
        write.restype = ctypes.c_int
        write.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, ptr] + [i64] * 5
        self._write = write

    @staticmethod
    def handles(device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cpu" and dtype == torch.float32

    @classmethod
    def supports(cls, cache: torch.Tensor) -> bool:
        return cls.handles(cache.device, cache.dtype) and cache.is_contiguous()

    def write_kv(self, cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Copy keys ``k`` and values ``v`` [kv_heads, T, d] (any strides, unit along d) into ``cache``'s
        flat slots ``slots`` [T] int64, as ``index_copy_`` along the slot dimension does; False (nothing
        written) where the tensors do not fit the kernel, so the caller copies with torch instead."""
        _, kv_heads, num_blocks, block_size, d = cache.shape
        # Called per layer and forward, so the checks are kept to plain attribute reads.
        if (
            k.dtype != torch.float32
            or v.dtype != torch.float32
            or cache.dtype != torch.float32
            or k.shape != v.shape
            or k.shape != (kv_heads, slots.shape[0], d)
            or k.stride(2) != 1
            or v.stride(2) != 1
            or slots.dtype != torch.int64
            or not slots.is_contiguous()
            or not cache.is_contiguous()
            or cache.device.type != "cpu"
        ):
            return False
        base = cache.data_ptr()
        k_st, k_sh = k.stride(1), k.stride(0)
        v_st, v_sh = v.stride(1), v.stride(0)
        status = self._write(
            k.data_ptr(), k_st, k_sh, v.data_ptr(), v_st, v_sh, base, base + 4 * cache.stride(0),
            slots.data_ptr(), slots.shape[0], kv_heads, num_blocks * block_size, d, torch.get_num_threads(),
        )  # fmt: skip
        if status:
            raise IndexError("KV write: a slot lies outside the cache")
        return True

    def __call__(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        cache: torch.Tensor,
        token_index: torch.Tensor,
        block_table: torch.Tensor,
        lengths: torch.Tensor,
        max_len: int,
        scaling: float,
        softcap: float | None = None,
        alibi_slopes: torch.Tensor | None = None,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """``out`` [tokens, heads, d] contiguous; ``q`` [heads, tokens, d]; ``cache`` one layer's
        [2, kv_heads, num_blocks, block_size, d]; ``block_table`` [rows, max_blocks] int64; ``lengths``
        [rows] int64 keys per row (its position + 1); ``token_index`` [rows] int64 rows of ``q``/``out``.
        ``softcap``: scores become ``softcap * tanh(score / softcap)``; ``alibi_slopes`` [heads] float32:
        ``slope * (key - query)`` is added to each score; ``window``: a row attends only its last
        ``window`` keys (table entries before them are never read); ``sinks`` [heads] float32: one more
        logit per head in the softmax's denominator (gpt-oss)."""
        if q.stride(2) != 1:
            q = q.contiguous()
        heads, _, head_dim = q.shape
        _, kv_heads, num_blocks, block_size, cache_dim = cache.shape
        # The C code trusts these; a mismatch would read or write out of bounds, so check them here.
        if q.dtype != torch.float32 or out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError("paged decode kernel: q and out must be float32, out contiguous")
        if head_dim != cache_dim or heads % kv_heads or out.shape[1:] != (heads, head_dim):
            raise ValueError(
                f"paged decode kernel: q {tuple(q.shape)}, out {tuple(out.shape)} and cache "
                f"{tuple(cache.shape)} disagree on heads or head size"
            )
        for t in (token_index, block_table, lengths):
            if t.dtype != torch.int64 or not t.is_contiguous():
                raise ValueError("paged decode kernel: index tensors must be contiguous int64")
        rows, max_blocks = block_table.shape
        if alibi_slopes is not None and (
            alibi_slopes.dtype != torch.float32
            or alibi_slopes.shape != (heads,)
            or not alibi_slopes.is_contiguous()
        ):
            raise ValueError(f"paged decode kernel: ALiBi slopes must be {heads} contiguous float32 values")
        status = self._fn(
            q.data_ptr(),
            q.stride(1),
            q.stride(0),
            cache[0].data_ptr(),
            cache[1].data_ptr(),
            token_index.data_ptr(),
            block_table.data_ptr(),
            lengths.data_ptr(),
            out.data_ptr(),
            rows,
            max_blocks,
            heads,
            kv_heads,
            num_blocks,
            block_size,
            head_dim,
            max_len,
            scaling,
            softcap or 0.0,
            alibi_slopes.data_ptr() if alibi_slopes is not None else None,
            window or 0,
            sinks.data_ptr() if sinks is not None else None,
            torch.get_num_threads(),
        )
        if status:
            raise MemoryError("paged decode attention: no memory for a thread's scratch buffer")


def _kernel(
    name: str, source: Path, wrap: Callable[[ctypes.CDLL], NativeKernel | None], isa: str | None
) -> Any:
    """``wrap`` of the compiled ``source`` for the variant :func:`bm.cpu_isa.kernel_isa` picks
    (``isa`` caps it, else ``BM_CPU_ISA``), or None where kernels are switched off or it cannot be
    built; decided once per process and variant."""
    if not native_kernels_enabled() or sys.platform == "win32":
        return None
    variant = kernel_isa(name, isa)
    with _lock:
        if (name, variant) not in _loaded:
            lib = compile_kernel(source, variant)
            kernel = wrap(lib) if lib is not None else None
            if kernel is not None:
                kernel.isa = variant
            _loaded[name, variant] = kernel
        return _loaded[name, variant]


def paged_decode_kernel(isa: str | None = None) -> PagedDecodeKernel | None:
    """The compiled decode attention kernel, or None (see :func:`_kernel`)."""
    return _kernel("paged_decode", _SOURCE, PagedDecodeKernel, isa)


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as [rows, cols] with unit column stride and one row stride a kernel can step by (no
    overlapping rows), copying only where the view cannot give that."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < rows.shape[1]):
        rows = rows.contiguous()
    return rows


class SmallGemmKernel(NativeKernel):
    """``y = x @ W.T (+ bias)`` in float32 over a weight packed once into 16-column panels (AVX-512 or
    AVX2 + FMA register tiles; plain C in the scalar build).

    Faster than torch's default GEMM at every row count measured on SmolLM2-135M's shapes (AVX2 build on
    an AVX2 EPYC: 1.05-1.1x at 2,048 rows, 1.3-5x at 1-64) and than oneDNN with a prepacked weight
    (1.0-1.9x); the AVX-512 build is 1.4-1.9x the AVX2 one from 8 rows up (``benchmarks/cpu_isa.py``).
    Each output row is computed alone, in one order, so results do not depend on the rest of the batch.
    """

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.bm_small_gemm_f32
        fn.restype = ctypes.c_int
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64]
        self._fn = fn
        ex = lib.bm_small_gemm_f32_ex
        ex.restype = ctypes.c_int
        ex.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64]
        # The fused epilogues (SiLU-gated pair, residual add) exist in the AVX-512 build only: elsewhere the
        # caller runs the separate ops, which compute the same values.
        self.fuses_epilogues = bool(lib.bm_small_gemm_avx512())
        self._ex = ex

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        """``[N, K]`` -> ``[ceil(N / 16), K, 16]`` panels, k-major, the last one zero-padded."""
        n, k = weight.shape
        panels = -(-n // PANEL)
        padded = weight.new_zeros(panels * PANEL, k)
        padded[:n] = weight
        return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()

    def __call__(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        bias: torch.Tensor | None,
        n: int,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x`` [..., K] float32; ``packed`` from :meth:`pack`; returns [..., n], plus ``residual``
        ([..., n], added after the bias as torch's ``residual + linear(x)`` does) where given: only where
        :attr:`fuses_epilogues`."""
        k = x.shape[-1]
        if packed.dtype != torch.float32 or x.dtype != torch.float32 or packed.shape[1:] != (k, PANEL):
            raise ValueError(
                f"small GEMM: x {tuple(x.shape)} {x.dtype} against packed {tuple(packed.shape)} {packed.dtype}"
            )
        if packed.shape[0] * PANEL < n or (
            bias is not None and (bias.numel() != n or not bias.is_contiguous())
        ):
            raise ValueError(f"small GEMM: {n} outputs do not fit the packed weight or the bias")
        if residual is not None and (residual.dtype != torch.float32 or residual.shape != (*x.shape[:-1], n)):
            raise ValueError(
                f"small GEMM: residual {tuple(residual.shape)} for {n} outputs of x {tuple(x.shape)}"
            )
        return self._launch("small GEMM", x, packed, None, bias, residual, n)

    def gated(self, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, n: int) -> torch.Tensor:
        """``silu(x @ G^T) * (x @ U^T)`` from two packed weights of ``n`` outputs (a multiple of 16, no
        bias), bit for bit the two GEMMs and ElementwiseKernels.silu_mul; only where
        :attr:`fuses_epilogues`."""
        k = x.shape[-1]
        if (
            x.dtype != torch.float32
            or gate.dtype != torch.float32
            or gate.shape != up.shape
            or gate.shape[1:] != (k, PANEL)
            or n % PANEL
            or gate.shape[0] * PANEL != n
        ):
            raise ValueError(
                f"gated GEMM: x {tuple(x.shape)} against {tuple(gate.shape)} and {tuple(up.shape)}"
            )
        return self._launch("gated GEMM", x, gate, up, None, None, n)

    def _launch(
        self,
        what: str,
        x: torch.Tensor,
        packed: torch.Tensor,
        up: torch.Tensor | None,
        bias: torch.Tensor | None,
        residual: torch.Tensor | None,
        n: int,
    ) -> torch.Tensor:
        """One call of the compiled GEMM on checked arguments: the plain entry point, or the one with the
        fused epilogues where ``up`` or ``residual`` is given."""
        rows = as_rows(x)
        out = torch.empty(rows.shape[0], n, dtype=torch.float32)
        bias_ptr = None if bias is None else bias.data_ptr()
        threads = torch.get_num_threads()
        if up is None and residual is None:
            status = self._fn(
                rows.data_ptr(), rows.stride(0), packed.data_ptr(), bias_ptr, out.data_ptr(), n,
                rows.shape[0], n, rows.shape[1], threads,
            )  # fmt: skip
        else:
            add = None if residual is None else as_rows(residual)
            status = self._ex(
                rows.data_ptr(), rows.stride(0), packed.data_ptr(), None if up is None else up.data_ptr(),
                bias_ptr, None if add is None else add.data_ptr(), 0 if add is None else add.stride(0),
                out.data_ptr(), n, rows.shape[0], n, rows.shape[1], threads,
            )  # fmt: skip
        if status:
            raise RuntimeError(f"{what}: the compiled kernel refused its arguments ({status})")
        return out.view(*x.shape[:-1], n)


def small_gemm_kernel(isa: str | None = None) -> SmallGemmKernel | None:
    """The compiled panel GEMM (AVX-512, AVX2 or plain C: batch invariant in each), or None (see
    :func:`_kernel`)."""
    return _kernel(
        "small_gemm",
        _GEMM_SOURCE,
        lambda lib: SmallGemmKernel(lib) if lib.bm_small_gemm_available() == 1 else None,
        isa,
    )


class PrefillAttentionKernel(NativeKernel):
    """Causal attention of one context chunk's queries to its own keys, or to a cached prefix read by
    block table plus its own keys (flash-attention style, AVX-512 or AVX2/FMA register tiles; plain C
    in the scalar build).

    At SmolLM2-135M's shape (head size 64, 9 query heads over 3 kv heads, two threads) 1.6-2.2x torch's
    CPU flash attention on whole prompts of 64-1024 tokens (up to 79% of the 2048^3 matmul peak, against
    SDPA's 50%), 1.4-1.5x after a cached prefix: ``benchmarks/prefill_attention.py``.
    """

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.bm_prefill_attention_f32
        fn.restype = ctypes.c_int
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, ptr, ptr, ptr, i64, i64, ptr]
        fn.argtypes += [i64] * 6 + [ctypes.c_float, i64, i64]
        self._fn = fn
        self.vectorized = bool(lib.bm_prefill_attention_vectorized())

    @staticmethod
    def handles(device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cpu" and dtype == torch.float32

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
    ) -> None:
        """Writes ``out[start:end]`` for the chunk of query tokens ``[start, end)`` of the packed batch.

        ``out`` [tokens, heads, d] contiguous; ``q`` [heads, tokens, d]; ``k``/``v`` [kv_heads, tokens, d]
        (any token and head strides, unit stride within a head). Without ``block_table`` the chunk is a
        whole prompt (``prefix_len`` 0) attending its own keys ``k``/``v[:, start:end]``; with it, its query
        tokens sit at positions ``prefix_len ..`` and every key, the chunk's own included, is read from
        ``cache`` (one layer's [2, kv_heads, num_blocks, block_size, d]) through ``block_table``, the
        request's first blocks in order. ``vectorize=False`` runs the plain C loops (for tests)."""
        heads, _, head_dim = q.shape
        kv_heads = k.shape[0]
        length = end - start
        # The C code trusts these; a mismatch would read or write out of bounds, so check them here.
        if any(t.dtype != torch.float32 for t in (out, q, k, v)) or not out.is_contiguous():
            raise ValueError("prefill attention kernel: float32 tensors and a contiguous out expected")
        if (
            heads % kv_heads
            or out.shape[1:] != (heads, head_dim)
            or k.shape[::2] != (kv_heads, head_dim)
            or v.shape != k.shape
            or not 0 <= start <= end <= min(out.shape[0], q.shape[1], k.shape[1])
        ):
            raise ValueError(
                f"prefill attention kernel: out {tuple(out.shape)}, q {tuple(q.shape)}, k {tuple(k.shape)}, "
                f"v {tuple(v.shape)} and tokens [{start}, {end}) disagree"
            )
        if q.stride(2) != 1:
            q = q.contiguous()
        if k.stride(2) != 1 or v.stride(2) != 1 or k.stride() != v.stride():
            k, v = k.contiguous(), v.contiguous()
        ck = cv = None
        blocks = block_size = 0
        if block_table is not None:
            if cache is None or not cache.is_contiguous() or cache.dtype != torch.float32:
                raise ValueError("prefill attention kernel: a block table needs the float32 contiguous cache")
            if cache.shape[1] != kv_heads or cache.shape[4] != head_dim:
                raise ValueError(
                    f"prefill attention kernel: cache {tuple(cache.shape)} against k {tuple(k.shape)}"
                )
            blocks, block_size = cache.shape[2], cache.shape[3]
            if (
                block_table.dtype != torch.int64
                or not block_table.is_contiguous()
                or block_table.numel() * block_size < prefix_len + length
            ):
                raise ValueError(
                    f"prefill attention kernel: the block table must be contiguous int64 covering all "
                    f"{prefix_len + length} keys"
                )
            ck, cv = cache[0].data_ptr(), cache[1].data_ptr()
        elif prefix_len:
            raise ValueError("prefill attention kernel: a cached prefix is read through a block table")
        status = self._fn(
            q.data_ptr() + start * q.stride(1) * 4, q.stride(1), q.stride(0),
            k.data_ptr() + start * k.stride(1) * 4, v.data_ptr() + start * v.stride(1) * 4,
            k.stride(1), k.stride(0), ck, cv,
            None if block_table is None else block_table.data_ptr(), blocks, block_size,
            out.data_ptr() + start * out.stride(0) * 4, out.stride(0),
            length, prefix_len, heads, kv_heads, head_dim, scaling, torch.get_num_threads(), int(vectorize),
        )  # fmt: skip
        if status:
            raise MemoryError("prefill attention: no memory for the packed keys or a thread's tile")


def prefill_attention_kernel(isa: str | None = None) -> PrefillAttentionKernel | None:
    """The compiled prefill attention kernel, or None (see :func:`_kernel`)."""
    return _kernel("prefill_attention", _PREFILL_SOURCE, PrefillAttentionKernel, isa)


class _LoraWeightsStruct(ctypes.Structure):
    _fields_ = [
        ("a", ctypes.c_void_p),
        ("b", ctypes.c_void_p),
        ("rank", ctypes.c_void_p),
        ("slots", ctypes.c_int64),
        ("R", ctypes.c_int64),
        ("K", ctypes.c_int64),
        ("N", ctypes.c_int64),
    ]


class LoraDeltaWeights:
    """One linear's stacked adapters as the LoRA kernel reads them: checked once, when they are
    (re)allocated, so the per-forward call only passes a pointer. Holds the tensors it points into."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, rank: torch.Tensor) -> None:
        slots, r, k = a.shape
        if (
            a.dtype != torch.float32
            or b.dtype != torch.float32
            or rank.dtype != torch.int64
            or b.shape[:2] != (slots, r)
            or rank.shape != (slots,)
            or not (a.is_contiguous() and b.is_contiguous() and rank.is_contiguous())
            or a.device.type != "cpu"
            or b.device.type != "cpu"
        ):
            raise ValueError(
                f"LoRA kernel: A {tuple(a.shape)} {a.dtype}, B {tuple(b.shape)} {b.dtype} and rank "
                f"{tuple(rank.shape)} {rank.dtype} must be contiguous CPU float32 [slots, R, K], "
                "[slots, R, N] and int64 [slots]"
            )
        self.tensors = (a, b, rank)
        self.in_features, self.out_features = k, b.shape[2]
        self.struct = _LoraWeightsStruct(a.data_ptr(), b.data_ptr(), rank.data_ptr(), slots, r, k, b.shape[2])
        self.ref = ctypes.byref(self.struct)


class LoraDeltaKernel(NativeKernel):
    """``y[row] += (x[row] @ A[s].T) @ B[s]`` for each row with adapter slot ``s >= 0``, in one call per
    linear (``native/lora_delta.c``). Built on every CPU: with AVX2 + FMA it runs vector code, elsewhere
    the same loops in plain C."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.bm_lora_delta_f32
        fn.restype = ctypes.c_int
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, i64]
        self._fn = fn
        self.avx2 = lib.bm_lora_delta_avx2() == 1

    def __call__(
        self, x: torch.Tensor, y: torch.Tensor, first: int, slots: torch.Tensor, weights: LoraDeltaWeights
    ) -> None:
        """Rows ``first .. first + len(slots)`` of ``x`` [..., K] and ``y`` [..., N] (contiguous float32,
        read as rows); ``slots`` int64, -1 for rows left alone. ``y`` is updated in place."""
        k, n = weights.in_features, weights.out_features
        rows = slots.shape[0]
        if (
            x.dtype != torch.float32
            or y.dtype != torch.float32
            or x.shape[-1] != k
            or y.shape[-1] != n
            or not x.is_contiguous()
            or not y.is_contiguous()
            or first < 0
            or (first + rows) * k > x.numel()
            or (first + rows) * n > y.numel()
            or slots.dtype != torch.int64
            or not slots.is_contiguous()
        ):
            raise ValueError(
                f"LoRA kernel: x {tuple(x.shape)} {x.dtype}, y {tuple(y.shape)} {y.dtype} (contiguous: "
                f"{x.is_contiguous()}, {y.is_contiguous()}), rows {first}..{first + rows} and slots "
                f"{slots.dtype} do not fit weights [{k} -> {n}]"
            )
        status = self._fn(
            x.data_ptr() + 4 * first * k, k, y.data_ptr() + 4 * first * n, n, slots.data_ptr(), rows,
            weights.ref, torch.get_num_threads(),
        )  # fmt: skip
        if status:
            raise ValueError("LoRA kernel: an adapter's rank exceeds its stacked rows")


def lora_delta_kernel(isa: str | None = None) -> LoraDeltaKernel | None:
    """The compiled LoRA delta kernel, or None (see :func:`_kernel`)."""
    return _kernel("lora_delta", _LORA_SOURCE, LoraDeltaKernel, isa)


def kernel_inputs(
    tensors: tuple[torch.Tensor, ...], dtypes: tuple[torch.dtype, ...], device_type: str
) -> bool:
    """Whether ``tensors`` share one dtype of ``dtypes`` on ``device_type``, with autograd off: what the
    fused chains' kernels (these C passes, or bm.runtime.triton.elementwise on CUDA) take."""
    dtype = tensors[0].dtype
    return (
        dtype in dtypes
        and not torch.is_grad_enabled()
        and all(t.dtype == dtype and t.device.type == device_type for t in tensors)
    )


class ElementwiseKernels(NativeKernel):
    """A decoder layer's elementwise chains (RMSNorm, SiLU(gate) * up, rotary) each in one C pass, on
    float32 or bfloat16 tensors (the bf16 passes round each intermediate as torch's bf16 ops do).

    The callers (bm.runtime.fusion) check dtype, device and layout first (:meth:`accepts`); these methods
    only reshape and check what the C code would otherwise read out of bounds.
    """

    device_type = "cpu"

    @functools.cached_property  # read on every fused call; ``isa`` is set right after construction
    def dtypes(self) -> tuple[torch.dtype, ...]:
        """float32 in every build; bfloat16 in the AVX-512 one, whose passes convert sixteen lanes at a
        time (the plain C bf16 loops, left to the compiler, ran SiLU 6x slower than torch's own)."""
        return (torch.float32, torch.bfloat16) if self.isa == "avx512" else (torch.float32,)

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        signatures = {
            "rms_norm": [ptr, i64, ptr, ptr, i64, i64, f32, i64],
            "add_rms_norm": [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, f32, i64],
            "silu_mul": [ptr, i64, ptr, i64, ptr, i64, i64, i64],
            "rotary": [ptr, i64, i64, ptr, ptr, ptr, i64, i64, i64, i64],
        }
        self._fns: dict[tuple[str, torch.dtype], Any] = {}
        for name, argtypes in signatures.items():
            for dtype, suffix in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
                fn = getattr(lib, f"bm_{name}_{suffix}")
                fn.restype = None
                fn.argtypes = argtypes
                self._fns[name, dtype] = fn

    def accepts(self, *tensors: torch.Tensor) -> bool:
        """Whether these are tensors the C passes take: CPU, one dtype of :attr:`dtypes`, no autograd."""
        return kernel_inputs(tensors, self.dtypes, self.device_type)

    def _fn(self, name: str, *tensors: torch.Tensor) -> Any:
        dtype = tensors[0].dtype
        if any(t.dtype != dtype for t in tensors) or (name, dtype) not in self._fns:
            raise ValueError(f"{name} kernel: dtypes {[str(t.dtype) for t in tensors]}")
        return self._fns[name, dtype]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``weight * (x * rsqrt(mean(x**2, -1) + eps))`` over the last dimension, in ``x``'s dtype."""
        cols = x.shape[-1]
        if weight.shape != (cols,) or not weight.is_contiguous():
            raise ValueError(f"RMSNorm kernel: weight {tuple(weight.shape)} for rows of {cols}")
        fn = self._fn("rms_norm", x, weight)
        rows = as_rows(x)
        out = torch.empty(x.shape, dtype=x.dtype)
        fn(
            rows.data_ptr(), rows.stride(0), weight.data_ptr(), out.data_ptr(), rows.shape[0], cols, eps,
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    def add_rms_norm(
        self, a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(s, rms_norm(s, weight, eps))`` with ``s = a + b``, in one pass: a decoder layer's residual
        add and the norm after it, bitwise what ``a + b`` then :meth:`rms_norm` give."""
        cols = a.shape[-1]
        if a.shape != b.shape or weight.shape != (cols,) or not weight.is_contiguous():
            raise ValueError(
                f"add-RMSNorm kernel: a {tuple(a.shape)}, b {tuple(b.shape)}, weight {tuple(weight.shape)}"
            )
        fn = self._fn("add_rms_norm", a, b, weight)
        s = torch.empty(a.shape, dtype=a.dtype)
        out = torch.empty(a.shape, dtype=a.dtype)
        # Called twice per layer and forward: the contiguous inputs of a packed batch skip the row views.
        ra = a if a.is_contiguous() else as_rows(a)
        rb = b if b.is_contiguous() else as_rows(b)
        lda = cols if ra is a else ra.stride(0)
        ldb = cols if rb is b else rb.stride(0)
        fn(
            ra.data_ptr(), lda, rb.data_ptr(), ldb, weight.data_ptr(), s.data_ptr(), out.data_ptr(),
            s.numel() // cols if cols else 0, cols, eps, torch.get_num_threads(),
        )  # fmt: skip
        return s, out

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up``, same shapes, in their dtype."""
        if gate.shape != up.shape:
            raise ValueError(f"SiLU-mul kernel: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
        fn = self._fn("silu_mul", gate, up)
        g, u = as_rows(gate), as_rows(up)
        out = torch.empty(gate.shape, dtype=gate.dtype)
        fn(
            g.data_ptr(), g.stride(0), u.data_ptr(), u.stride(0), out.data_ptr(), g.shape[0], g.shape[1],
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x * cos + rotate_half(x) * sin`` for ``x`` [tokens, heads, d] (unit stride along d) and
        ``cos``/``sin`` [tokens, d]; returns a contiguous [tokens, heads, d] in ``x``'s dtype."""
        tokens, heads, d = x.shape
        if d % 2 or cos.shape != (tokens, d) or sin.shape != (tokens, d):
            raise ValueError(f"rotary kernel: x {tuple(x.shape)} with cos {tuple(cos.shape)}")
        fn = self._fn("rotary", x, cos, sin)
        if x.stride(2) != 1:
            x = x.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        out = torch.empty(tokens, heads, d, dtype=x.dtype)
        fn(
            x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
            tokens, heads, d, torch.get_num_threads(),
        )  # fmt: skip
        return out


def elementwise_kernels(isa: str | None = None) -> ElementwiseKernels | None:
    """The compiled elementwise chains, or None (see :func:`_kernel`)."""
    return _kernel("elementwise", _ELEMENTWISE_SOURCE, ElementwiseKernels, isa)


def kv_cache_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype for a model of ``dtype`` on ``device``: the model's, except a bfloat16 or
    float16 model on the CPU, whose keys and values are kept in float32 (each value exactly, as a wider
    float holds a narrower one) so that the float32 attention kernels here read them in place: the torch
    path they would otherwise take gathers every block and runs SDPA per group, about three times slower
    (docs/cpu-kernels.md, "bfloat16 on the CPU")."""
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return dtype


def runtime_info(device: torch.device | str, dtype: torch.dtype) -> dict[str, object]:
    """What a results file needs to say for its figures to be compared with another machine's."""
    dev = torch.device(device)
    kv_dtype = kv_cache_dtype(dev, dtype)
    native = PagedDecodeKernel.handles(dev, kv_dtype) and paged_decode_kernel() is not None
    return {
        "torch": torch.__version__,
        "device": str(dev),
        "torch_threads": torch.get_num_threads(),
        "decode_attention": "native" if native else "torch",
        # the instruction set each compiled kernel runs (bm.cpu_isa), when they are on
        "cpu_isa": {name: kernel_isa(name) for name in KERNEL_ISAS} if native_kernels_enabled() else {},
    }
