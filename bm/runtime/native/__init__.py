"""bm's C kernels: compiled from source at first use with the machine's C compiler, one module each.

Each kernel is built for the instruction set :mod:`bm.cpu_isa` picks from the CPU's features
(AVX-512, AVX2 or scalar; ``BM_CPU_ISA`` caps it; ``isa.h`` is the one definition of what a variant
enables) and cached per machine (:mod:`bm.runtime.native.build`). Where nothing can be built (no
compiler, an unusual platform, or ``BM_NATIVE_KERNELS=0`` in the environment), bm runs its torch
implementation of the same computation, which gives the same results up to float rounding; tests pin
that the two agree, for every variant the machine runs.

Beside each C source ``<name>.c`` sits its Python wrapper ``<name>.py`` (the ctypes signature, the
argument checks the C code relies on, the call); :mod:`.args` holds the checks every wrapper shares and
:mod:`.loader` the build-once-per-process loading. This package re-exports the wrappers.
"""

from __future__ import annotations

import os
import platform

import torch

from bm.cpu_isa import ENV_ISA, KERNEL_ISAS, bf16_kv_cache, cpu_features, kernel_isa
from bm.runtime.native.args import as_rows, kernel_inputs
from bm.runtime.native.bf16_gemm import Bf16GemmKernel, bf16_gemm_kernel
from bm.runtime.native.elementwise import ElementwiseKernels, elementwise_kernels
from bm.runtime.native.group_gemm import GroupGemmKernel, GroupWeight, group_gemm_kernel
from bm.runtime.native.int8_gemm import Int8GemmKernel, int8_gemm_kernel
from bm.runtime.native.loader import ENV_SWITCH, NativeKernel, native_kernels_enabled
from bm.runtime.native.lora_delta import LoraDeltaKernel, LoraDeltaWeights, lora_delta_kernel
from bm.runtime.native.paged_decode import DecodeRows, PagedDecodeKernel, paged_decode_kernel
from bm.runtime.native.prefill_attention import PrefillAttentionKernel, prefill_attention_kernel
from bm.runtime.native.small_gemm import PANEL, SmallGemmKernel, small_gemm_kernel

__all__ = [
    "ENV_SWITCH",
    "PANEL",
    "Bf16GemmKernel",
    "DecodeRows",
    "ElementwiseKernels",
    "GroupGemmKernel",
    "GroupWeight",
    "Int8GemmKernel",
    "LoraDeltaKernel",
    "LoraDeltaWeights",
    "NativeKernel",
    "PagedDecodeKernel",
    "PrefillAttentionKernel",
    "SmallGemmKernel",
    "as_rows",
    "bf16_gemm_kernel",
    "elementwise_kernels",
    "group_gemm_kernel",
    "int8_gemm_kernel",
    "kernel_inputs",
    "kv_cache_dtype",
    "lora_delta_kernel",
    "native_kernels_enabled",
    "paged_decode_kernel",
    "prefill_attention_kernel",
    "runtime_info",
    "small_gemm_kernel",
]


def kv_cache_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype for a model of ``dtype`` on ``device``: the model's, except on the CPU
    where bm's attention kernels must read it in place (the torch path they would otherwise take gathers
    every block and runs SDPA per group, about three times slower; docs/cpu-kernels.md, "bfloat16 on the
    CPU"):

    - bfloat16 stays bfloat16 where both attention kernels load their AVX-512 build, which reads bf16
      keys and values (:func:`bm.cpu_isa.bf16_kv_cache`): half the bytes a decode step reads;
    - otherwise a bfloat16 or float16 model's keys and values are kept in float32 (each value exactly, as
      a wider float holds a narrower one) for the float32 kernels."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return dtype
    if dtype == torch.bfloat16 and _bf16_attention_kernels():
        return torch.bfloat16
    return torch.float32


def _bf16_attention_kernels() -> bool:
    """Whether this process's decode and prefill attention kernels both read a bf16 cache (the builds
    :func:`bm.cpu_isa.bf16_kv_cache` names, and they were built)."""
    if not native_kernels_enabled() or not bf16_kv_cache(
        cpu_features(), platform.machine(), os.environ.get(ENV_ISA)
    ):
        return False
    decode, prefill = paged_decode_kernel(), prefill_attention_kernel()
    return (
        decode is not None
        and prefill is not None
        and torch.bfloat16 in decode.dtypes
        and torch.bfloat16 in prefill.dtypes
    )


def runtime_info(
    device: torch.device | str, dtype: torch.dtype, weights: str | None = None
) -> dict[str, object]:
    """What a results file needs to say for its figures to be compared with another machine's, and
    ``weights``: the model's linears as they ran (model.quantization resolved: none, int8, gguf, gptq,
    awq), where known."""
    dev = torch.device(device)
    kv_dtype = kv_cache_dtype(dev, dtype)
    native = PagedDecodeKernel.handles(dev, kv_dtype) and paged_decode_kernel() is not None
    return {
        "torch": torch.__version__,
        "device": str(dev),
        **({"weights": weights} if weights is not None else {}),
        "torch_threads": torch.get_num_threads(),
        "decode_attention": "native" if native else "torch",
        # the instruction set each compiled kernel runs (bm.cpu_isa), when they are on
        "cpu_isa": {name: kernel_isa(name) for name in KERNEL_ISAS} if native_kernels_enabled() else {},
    }
