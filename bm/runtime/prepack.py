"""Linear layers with weights packed once, for every GEMM of a bm forward.

On the CPU, torch's default GEMM (MKL ``sgemm``) packs the weight matrix again on every call. With the
few rows of a decode iteration (1-256 tokens) that repacking, not the arithmetic, is most of the cost.
Two packed paths, measured on a 2-core AVX2 EPYC with SmolLM2-135M's shapes (``benchmarks/small_gemm.py``):

* bm's own panel GEMM (``native/small_gemm.c``, AVX-512 / AVX2 builds chosen by bm.cpu_isa, compiled
  once per machine; the AVX2 build): 1.3-5x faster than
  MKL at 1-64 rows and still 1.05-1.1x at 2,048 (190-196 GFLOP/s, where a 2048-cubed ``torch.mm`` peaks at
  about 185), so it serves every row count;
* where that kernel is unavailable (no compiler), oneDNN with a prepacked weight: 1.1-2.8x
  faster at 2-128 rows, 2-4.5x for the 49k-row vocabulary projection, even at 256 and slower from 512,
  so it serves up to ``MAX_PACKED_ROWS`` rows and MKL the rest.

bfloat16 weights (``model.dtype: bfloat16`` on a CPU whose oneDNN runs bfloat16: AVX512_BF16 or AMX) are
packed for oneDNN at every row count: ``F.linear`` reaches the same oneDNN kernel, with the same results
(tests/test_prepack_bf16.py), but reorders the weight on every call first. Under
``model.cpu_bf16_gemm: invariant`` (``auto`` on a CPU with AVX512_BF16 and no AMX: bm.cpu_isa.cpu_bf16_gemm)
they are packed for bm's own bf16 panel GEMM instead (``native/bf16_gemm.c``), whose rows are batch
invariant, which oneDNN's are not.

The packed copy doubles the memory of the linear weights, so ``model.prepack`` ``auto`` packs only
fp32 and bf16 CPU models whose linear weights take at most a quarter of the machine's memory. The packed path runs
only inside a bm forward: the same module called by anything else (``generate()`` in the oracle tests,
a user's own code) computes exactly as transformers does. A weight changed in place after packing is
noticed (its version counter moves) and packed again.
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable

import torch
from torch import nn

from bm.runtime.attention import in_bm_forward
from bm.runtime.native import Bf16GemmKernel, SmallGemmKernel, bf16_gemm_kernel, small_gemm_kernel
from bm.runtime.native.args import BoundGemm

# Inputs with at most this many rows take the oneDNN path (see the module docstring for the measurement).
MAX_PACKED_ROWS = 256
# The batch size oneDNN tunes the packed layout for; 16-128 measured alike, 1 was worse.
_PACK_HINT = 64
_MEMORY_SHARE = 0.25
_PACKED_DTYPES = (torch.float32, torch.bfloat16)


def prepack_supported(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why packing cannot be used here, or None when it can."""
    if device.type != "cpu":
        return f"prepacked weights are a CPU path; the model is on {device}"
    if dtype == torch.bfloat16:
        if not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return "bfloat16 weights are packed for oneDNN, which this torch or CPU does not run in bfloat16"
        return None
    if dtype != torch.float32:
        return f"prepacked weights are measured and tested for float32 and bfloat16 only, not {dtype}"
    if small_gemm_kernel() is None and not torch.backends.mkldnn.is_available():
        return "neither bm's compiled GEMM (it needs a C compiler) nor oneDNN is available here"
    return None


def _linear_weight_bytes(model: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            total += module.weight.numel() * module.weight.element_size()
    return total


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, AttributeError):
        return None


def should_prepack(mode: str, model: nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
    """``on`` packs wherever supported (raising where not), ``auto`` also checks the memory, ``off`` never."""
    if mode == "off":
        return False
    why_not = prepack_supported(device, dtype)
    if mode == "on":
        if why_not:
            raise ValueError(f"model.prepack is on, but {why_not}; set model.prepack to auto or off")
        return True
    if why_not:
        return False
    memory = _physical_memory()
    return memory is None or _linear_weight_bytes(model) <= _MEMORY_SHARE * memory


def prepack_linears(model: nn.Module, bf16_gemm: str = "onednn") -> int:
    """Give every plain float32 or bfloat16 ``nn.Linear`` of ``model`` a packed weight; returns how many
    were packed. ``bf16_gemm`` (onednn or invariant, as :func:`bm.cpu_isa.cpu_bf16_gemm` resolved
    ``model.cpu_bf16_gemm``) is the kernel bfloat16 weights are packed for.

    Subclasses that override ``forward`` keep it unpacked.
    Weights that are not plain tensors (sharded DTensors, quantized or meta tensors) are left as they are.
    """
    packed = 0
    for module in model.modules():
        # only layers computing exactly nn.Linear's forward (a subclass like a MoE router has its own)
        if type(module).forward is not nn.Linear.forward or isinstance(module.forward, _PackedForward):
            continue
        weight = module.weight
        if type(weight.data) is not torch.Tensor or weight.dtype not in _PACKED_DTYPES or weight.is_meta:
            continue
        module.forward = _PackedForward(module, bf16_gemm)
        packed += 1
    return packed


def unpack_linears(model: nn.Module) -> None:
    """Undo :func:`prepack_linears` (frees the packed copies)."""
    for module in model.modules():
        if isinstance(module, nn.Linear) and isinstance(module.forward, _PackedForward):
            del module.forward


def fusable_gemm(linear: nn.Module) -> tuple[SmallGemmKernel, torch.Tensor] | None:
    """(kernel, packed weight) of a linear whose forward is a packed panel GEMM whose build fuses
    epilogues, with nothing wrapped around it; else None. A LoRA adapter replaces the forward; a forward
    hook (transformers' tensor-parallel plan all-reduces a row-split layer's output in one) runs only
    when the module is called, which a fused epilogue would skip."""
    forward = getattr(linear, "__dict__", {}).get("forward")
    if not isinstance(forward, _PackedForward) or has_forward_hooks(linear):
        return None
    return forward.fusable()


def has_forward_hooks(module: nn.Module) -> bool:
    """Whether calling ``module`` runs hooks around its forward (its own or global ones)."""
    from torch.nn.modules import module as module_impl

    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module_impl._global_forward_hooks
        or module_impl._global_forward_pre_hooks
    )


class _PackedForward:
    """A Linear's forward: a packed GEMM inside a bm forward, the module's own otherwise."""

    def __init__(self, module: nn.Linear, bf16_gemm: str = "onednn") -> None:
        self.__setstate__({"_module": module, "_bf16_gemm": bf16_gemm})
        self._pack()

    # The packed tensor is opaque (no storage): copies and pickles of a model leave it out and pack again
    # on their first call inside a bm forward.
    def __deepcopy__(self, memo: dict) -> _PackedForward:
        import copy

        clone = _PackedForward.__new__(_PackedForward)
        clone.__setstate__({"_module": copy.deepcopy(self._module, memo), "_bf16_gemm": self._bf16_gemm})
        return clone

    def __getstate__(self) -> dict:
        return {"_module": self._module, "_bf16_gemm": self._bf16_gemm}

    def __setstate__(self, state: dict) -> None:
        module = state["_module"]
        self._module = module
        self._bf16_gemm: str = state.get("_bf16_gemm", "onednn")
        self._own: Callable[[torch.Tensor], torch.Tensor] = types.MethodType(type(module).forward, module)
        # chosen when packing, by the weight's dtype (and _bf16_gemm for bfloat16)
        self._kernel: SmallGemmKernel | Bf16GemmKernel | None = None
        self._packed: torch.Tensor | None = None
        self._key: tuple[int, int] | None = None  # the weight's (address, version) when packed
        # bm's float32 GEMM bound to the packed weight and the bias (their addresses when bound)
        self._bound: BoundGemm | None = None
        self._bound_key: tuple[int, int | None] | None = None

    def _pack(self) -> None:
        weight = self._module.weight
        # float32 takes bm's panel GEMM; bfloat16 takes bm's invariant bf16 GEMM where model.cpu_bf16_gemm
        # resolved to it, else oneDNN (AMX or AVX512_BF16 where the CPU has them), packed once instead of
        # reordered on every call as F.linear does
        if weight.dtype == torch.float32:
            self._kernel = small_gemm_kernel()
        elif self._bf16_gemm == "invariant":
            self._kernel = bf16_gemm_kernel()
            if self._kernel is None:
                raise RuntimeError("model.cpu_bf16_gemm is invariant, but bm's bf16 GEMM did not build here")
        else:
            self._kernel = None
        with torch.no_grad():
            if self._kernel is not None:
                self._packed = self._kernel.pack(weight.detach())
            else:
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_HINT)
        self._key = (weight.data_ptr(), weight._version)

    def _repack_if_changed(self) -> None:
        weight = self._module.weight
        if (weight.data_ptr(), weight._version) != self._key:
            self._pack()

    def fusable(self) -> tuple[SmallGemmKernel, torch.Tensor] | None:
        """(kernel, packed weight, current) where this layer's GEMM runs on bm's panel kernel and that
        build fuses epilogues (bm.runtime.fusion hands it a layer's activation or residual add); else
        None. A weight changed in place is packed again first, as :meth:`__call__` does."""
        if self._module.weight.dtype != torch.float32 or torch.is_grad_enabled():
            return None
        self._repack_if_changed()
        kernel = self._kernel
        if isinstance(kernel, SmallGemmKernel) and kernel.fuses_epilogues:
            return kernel, self._packed
        return None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        module = self._module
        weight = module.weight
        if x.dim() < 2 or x.dtype != weight.dtype or torch.is_grad_enabled() or not in_bm_forward():
            return self._own(x)
        self._repack_if_changed()
        kernel = self._kernel
        if isinstance(kernel, SmallGemmKernel):  # bound once: per call only x is checked
            bias = module.bias
            key = (self._packed.data_ptr(), None if bias is None else bias.data_ptr())
            if key != self._bound_key:
                self._bound = kernel.bind(self._packed, bias, module.out_features)
                self._bound_key = key
            return self._bound(x)
        if kernel is not None:
            return kernel(x, self._packed, module.bias, module.out_features)
        if x.dtype == torch.float32 and x.numel() > MAX_PACKED_ROWS * module.in_features:
            return self._own(x)  # float32 without bm's kernel: MKL is faster than oneDNN from 512 rows
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, module.bias, "none", [None], "")
