"""Weights quantized on load (``model.quantization: int8``): every linear of the decoder's layers keeps
int8 values with one float32 scale per output channel, and runs on bm's int8-weight GEMM
(:mod:`bm.runtime.native.int8_gemm`). Weight-only: activations, norms, embeddings, the output head and
the KV cache stay in ``model.dtype``.

The format, per output row ``n`` of a weight ``W [N, K]``: symmetric, ``scale[n] = max|W[n]| / 127`` (1
for an all-zero row), ``q[n, k] = round(W[n, k] / scale[n])`` (half to even) in [-127, 127]. A layer
computes ``(x @ q.T) * scale (+ bias)``: one float32 chain over k per output, the scale applied once at
its end. Its reference is the same layer with the weight expanded to ``q * scale`` in float32
(:func:`dequantized`): the two differ only in rounding (the scale applied after the sum instead of to
each product), so greedy output matches HF ``generate()`` on the expanded weights up to near-ties.

Why the output head stays full width: its logits choose every token, one matrix among many (SmolLM2:
tied to the embedding, whose rows a lookup reads), and the peers keep it so too (vLLM's and TensorRT-LLM's
weight-only schemes quantize the decoder's linears).

The quantized layer is the same ``nn.Linear``, so its hooks and name stay: ``weight`` becomes the packed
int8 panels (the layer's one copy of its weight, :meth:`Int8GemmKernel.pack`), ``weight_scale`` a buffer
beside it, and ``forward`` an :class:`Int8Forward`.

Tensor-parallel shards (transformers' tp_plan, :mod:`bm.parallel.tensor_parallel`) are quantized where
they are: each rank quantizes its local slice of a sharded weight, and the forward transformers installed
around the layer (inputs split or gathered, a row-split layer's output all-reduced, its bias added once)
keeps running, now around the int8 forward. A column-split layer's rows are whole on their rank; a
row-split layer's rows are split over the ranks, so their scales come from the row's maximum over every
rank (one all-reduce at load): each rank then holds exactly its slice of the single-process layer's q.
"""

from __future__ import annotations

import os
import types
from abc import ABC, abstractmethod
from collections.abc import Callable
from functools import cache
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from bm.runtime.native import Int8GemmKernel, int8_gemm_kernel
from bm.runtime.native.args import BoundGemm

QMAX = 127.0

# Which GEMM a quantized linear runs off the CPU's C kernels: auto (unset: Triton on CUDA where triton is
# installed) or triton (Triton on every device: the tests run it on the CPU, in Triton's interpreter).
ENV_GEMM = "BM_QUANT_GEMM"


# Each row's max|W| over the whole row, from this rank's maxima (a row-split shard's all-reduce)
RowMax = Callable[[torch.Tensor], torch.Tensor]


class WeightQuantError(ValueError):
    """A model ``model.quantization`` cannot be applied to; the message names why and the fix."""


def quantize_weight(weight: torch.Tensor, row_max: RowMax | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``W [N, K]`` -> (int8 ``q [N, K]``, float32 ``scale [N]``), symmetric per output channel.
    ``row_max``: each row's ``max|W|`` over the whole row where ``weight`` holds a slice of it (a
    row-split tensor-parallel shard: the maximum over every rank)."""
    w = weight.detach().float()
    scale = row_scales(w, QMAX, row_max)
    q = torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def row_scales(w: torch.Tensor, qmax: float, row_max: RowMax | None = None) -> torch.Tensor:
    """Each output row's symmetric scale, ``max|W[n]| / qmax`` (``row_max``: the maximum over the whole
    row for a row-split shard), 1 for an all-zero row: int8 on load's and FP8 on load's alike."""
    peak = w.abs().amax(1)
    scale = (row_max(peak) if row_max is not None else peak) / qmax
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight a quantized layer stands for: ``q * scale`` per output row."""
    return q.float() * scale[:, None]


def quantized_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The linears ``model.quantization`` quantizes: every ``nn.Linear`` but the output head (and any
    linear sharing its weight)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_weight = getattr(head, "weight", None)
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and module is not head and module.weight is not head_weight
    ]


# One linear quantized: (the module, its weight on this rank, the whole row's maximum for a row-split
# shard) -> the forward that runs what it installed on the module.
Quantizer = Callable[[nn.Linear, torch.Tensor, "RowMax | None"], "KernelForward"]


def quantize_linears(model: nn.Module, scheme: str, quantizer: Quantizer | None = None) -> int:
    """Quantize ``model``'s linears in place for ``scheme`` (``none``: nothing); returns how many.
    ``quantizer`` makes each layer's format (int8 rows by default; FP8 rows are
    bm.runtime.group_linears.install_fp8_rows, which bm.runtime.weight_sources passes): every scheme
    quantizes the same linears, refuses the same ones and keeps tensor-parallel wrappers the same way."""
    if scheme == "none":
        return 0
    if quantizer is None:
        if scheme != "int8":  # the config refuses unknown ones first; the rest are weight_sources'
            raise WeightQuantError(
                f"model.quantization: {scheme!r} is not quantized on load; allowed here: int8, fp8, none"
            )
        quantizer = _int8_rows
    linears = quantized_linears(model)
    wrapped = {}
    for name, module in linears:
        own = module.__dict__.get("forward")
        wrapped[name] = _tp_inner_forward(own) if own is not None else None
        if type(module).forward is not nn.Linear.forward or (own is not None and wrapped[name] is None):
            raise WeightQuantError(
                f"model.quantization: {scheme} quantizes plain linears; {name} ({type(module).__name__}) "
                "computes its own forward: drop model.quantization for this model"
            )
    with torch.no_grad():
        for name, module in linears:
            local, row_max = _local_weight(module.weight)
            forward = quantizer(module, local, row_max)
            if wrapped[name] is not None:  # transformers' tensor-parallel forward, now around the new one
                wrapped[name].cell_contents = forward
            else:
                module.forward = forward
    return len(linears)


def _int8_rows(module: nn.Linear, weight: torch.Tensor, row_max: RowMax | None) -> KernelForward:
    """int8 on load for one linear: its packed rows and their scales, run by :class:`Int8Forward`."""
    q, scale = quantize_weight(weight, row_max)
    module._parameters["weight"] = nn.Parameter(Int8GemmKernel.pack(q), requires_grad=False)
    module.register_buffer("weight_scale", scale)
    return Int8Forward(module)


def _tp_inner_forward(forward: Any) -> Any:
    """The closure cell holding the layer's own forward inside transformers' tensor-parallel wrapper
    (``TensorParallelLayer.install_forward``'s ``tp_forward``), or None for any other forward."""
    code = getattr(forward, "__code__", None)
    if code is None or code.co_name != "tp_forward" or forward.__closure__ is None:
        return None
    return dict(zip(code.co_freevars, forward.__closure__, strict=True)).get("original_forward")


def _local_weight(weight: torch.Tensor) -> tuple[torch.Tensor, RowMax | None]:
    """A weight's rows on this rank, and for a row-split shard (its input dimension split over the
    ranks) the all-reduce giving each row's maximum over the whole row."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(weight.data, DTensor):
        return weight, None
    dtensor = weight.data
    local = dtensor.to_local()
    if not any(isinstance(p, Shard) and p.dim in (1, -1) for p in dtensor.placements):
        return local, None
    group = dtensor.device_mesh.get_group()

    def row_max(peak: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        peak = peak.clone()
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        return peak

    return local, row_max


def expand_linears(model: nn.Module, dtype: torch.dtype) -> int:
    """Give every linear running a kernel's own weight format (:class:`KernelForward`) its expanded
    weight in ``dtype`` back, as a plain ``nn.Linear``: the model transformers would have computed with
    (the oracle tests' reference, a copy of bm's model). Returns how many."""
    count = 0
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if not isinstance(forward, KernelForward):
            continue
        weight = forward.expanded_weight(module).to(dtype)
        for name in ("weight_scale", "weight_step", "weight_offset"):
            module._buffers.pop(name, None)
        module._parameters["weight"] = nn.Parameter(weight, requires_grad=False)
        del module.forward
        count += 1
    return count


def int8_weight(module: nn.Linear) -> torch.Tensor:
    """A quantized linear's ``[N, K]`` int8 weight (this rank's slice under tensor parallelism),
    unpacked from its panels (a copy)."""
    return Int8GemmKernel.unpack(module.weight, module.weight_scale.numel())


class PanelWeight(NamedTuple):
    """A quantized linear's weight as the Triton GEMM reads it (bm.runtime.triton.weight_ops.panel_linear):
    the C kernels' own panels, so one copy serves both devices."""

    values: torch.Tensor
    step: torch.Tensor
    offset: torch.Tensor | None
    out_features: int
    bits: int
    group: int | None  # None: one scale per output, applied after the sum
    float8: bool = False


def _triton_gemm(x: torch.Tensor, group: int | None) -> bool:
    """Whether a quantized linear runs the Triton GEMM on ``x``: on CUDA with triton installed (or
    anywhere ``BM_QUANT_GEMM=triton``), for the dtypes and groups it takes."""
    forced = os.environ.get(ENV_GEMM, "auto")
    if forced not in ("auto", "triton"):
        raise WeightQuantError(f"{ENV_GEMM}={forced!r}: allowed auto (or unset) and triton")
    if forced == "auto" and x.device.type != "cuda":
        return False
    if not _has_triton():
        return False
    from bm.runtime.triton.weight_ops import serves

    return serves(x.dtype, group)


@cache
def _has_triton() -> bool:
    """triton installed, asked once: every quantized linear call on CUDA asks, and the package finder
    walks the path each time."""
    from bm.runtime.triton import triton_available

    return triton_available()


class KernelForward(ABC):
    """The forward of a linear whose weight is held in a C kernel's own format: on the CPU the kernel in
    float32 (the input widened from, and the output rounded to, a bfloat16 model's dtype); on CUDA the
    Triton GEMM over the same panels, in the model's dtype (bm.runtime.triton.weight_ops); else
    :meth:`torch_forward` (the kernel not built: ``BM_NATIVE_KERNELS=0``, no compiler; autograd; CUDA
    without triton): the same values up to rounding. A subclass names its kernel and how to call it."""

    def __init__(self, module: nn.Linear) -> None:
        self.__setstate__({"_module": module})

    @staticmethod
    @abstractmethod
    def load_kernel() -> Any:
        """The compiled kernel, or None where it is not built."""

    @abstractmethod
    def bind(self, kernel: Any, bias: torch.Tensor | None) -> BoundGemm:
        """The layer on ``kernel`` (``x`` float32 in, float32 out), its weight and ``bias`` (float32)
        checked once: what each CPU call then runs, until the layer's tensors change."""

    @staticmethod
    @abstractmethod
    def torch_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """The same layer in torch (the fallback)."""

    @staticmethod
    @abstractmethod
    def expanded_weight(module: nn.Linear) -> torch.Tensor:
        """The float32 ``[N, K]`` weight the layer stands for (its reference's)."""

    @abstractmethod
    def panels(self) -> PanelWeight:
        """The layer's weight as the Triton GEMM reads it."""

    # The compiled kernel is a handle of this process: copies and pickles of a model carry the module
    # only and find the kernel again where they land.
    def __getstate__(self) -> dict:
        return {"_module": self._module}

    def __setstate__(self, state: dict) -> None:
        module = state["_module"]
        self._module = module
        self._kernel = self.load_kernel()
        self._torch: Callable[[torch.Tensor], torch.Tensor] = types.MethodType(self.torch_forward, module)
        self._bound: BoundGemm | None = None
        self._bound_key: list | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return self._torch(x)
        # Triton on CUDA, or anywhere BM_QUANT_GEMM forces it; else the C kernel on the CPU, else torch
        if (not x.is_cpu or ENV_GEMM in os.environ) and (out := self._triton(x)) is not None:
            return out
        if x.is_cpu and self._kernel is not None:
            return self._on_cpu(x)
        return self._torch(x)

    def _on_cpu(self, x: torch.Tensor) -> torch.Tensor:
        """The layer on the C kernel, bound to the layer's tensors as they are now: bound again where
        one was replaced or moved (another address). A change in place needs nothing (the kernel reads
        the tensors themselves), but for a bias of another dtype, bound as a float32 copy: its version
        is part of the key (an inference tensor keeps none, so such a bias is bound on every call)."""
        module = self._module
        key = [
            t.data_ptr() for t in (*module._parameters.values(), *module._buffers.values()) if t is not None
        ]
        bias = module.bias
        if bias is not None and bias.dtype != torch.float32:
            key.append(None if bias.is_inference() else bias._version)
        if key != self._bound_key or None in key:
            self._bound = self.bind(self._kernel, None if bias is None else bias.detach().float())
            self._bound_key = key
        if x.dtype == torch.float32:
            return self._bound(x)
        return self._bound(x.float()).to(x.dtype)

    def _triton(self, x: torch.Tensor) -> torch.Tensor | None:
        """The layer on the Triton GEMM, or None where it does not run (:func:`_triton_gemm`)."""
        panels = self.panels()
        if not _triton_gemm(x, panels.group):
            return None
        from bm.runtime.triton.weight_ops import panel_linear

        bias = self._module.bias
        return panel_linear(
            x, panels.values, panels.step, panels.offset, None if bias is None else bias.detach(),
            out_features=panels.out_features, bits=panels.bits, group=panels.group, float8=panels.float8,
        )  # fmt: skip

    def __deepcopy__(self, memo: dict) -> KernelForward:
        import copy

        return type(self)(copy.deepcopy(self._module, memo))


class Int8Forward(KernelForward):
    """A quantized linear's forward: ``(x @ q.T) * scale (+ bias)`` on bm's int8 GEMM."""

    @staticmethod
    def load_kernel() -> Int8GemmKernel | None:
        return int8_gemm_kernel()

    def panels(self) -> PanelWeight:
        scale = self._module.weight_scale
        return PanelWeight(self._module.weight, scale, None, scale.numel(), 8, None)

    def bind(self, kernel: Int8GemmKernel, bias: torch.Tensor | None) -> BoundGemm:
        return kernel.bind(self._module.weight, self._module.weight_scale, bias)

    @staticmethod
    def expanded_weight(module: nn.Linear) -> torch.Tensor:
        return dequantized(int8_weight(module), module.weight_scale)

    @staticmethod
    def torch_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        q = int8_weight(module)
        bias = None if module.bias is None else module.bias.float()
        out = F.linear(x.float(), q.float()) * module.weight_scale
        return (out if bias is None else out + bias).to(x.dtype)
