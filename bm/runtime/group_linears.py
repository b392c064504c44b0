"""Linears whose weight is a :class:`GroupWeight` (small integers in groups, each with a float32 step and
offset), run by bm's group GEMM: what the GGUF reader (bm.runtime.gguf_weights) and the reader of checkpoints
stored quantized (bm.runtime.stored_checkpoints: GPTQ, AWQ, FP8) give a layer, and what FP8 on load
(``model.quantization: fp8`` on a full-width model, :func:`install_fp8_rows`) makes of one. The module
stays the same ``nn.Linear`` (its name and hooks stay); ``weight`` holds the packed values,
``weight_step`` and ``weight_offset`` the groups' parameters, and ``forward`` a :class:`GroupForward`.

FP8 on load, per output row ``n`` of ``W [N, K]``: ``scale[n] = max|W[n]| / 448`` (e4m3's largest
finite value; 1 for an all-zero row), ``u[n, k] = e4m3(W[n, k] / scale[n])`` rounded to nearest even,
and the layer computes with ``u * scale`` rounded once in float32: an FP8 checkpoint's per-channel layout
(compressed-tensors' ``channel`` strategy), so the same GEMM and the same oracle serve both. Per row, not
vLLM's one scale per tensor: a row of small weights keeps its own range, at four bytes a row."""

from __future__ import annotations

import torch
from torch import nn

from bm.runtime.native import GroupGemmKernel, GroupWeight, group_gemm_kernel
from bm.runtime.native.args import BoundGemm
from bm.runtime.weight_quant import KernelForward, PanelWeight, RowMax, WeightQuantError, row_scales

E4M3_MAX = 448.0


def install_group_weight(module: nn.Linear, weight: GroupWeight) -> None:
    """Make ``module`` run ``weight``: its packed values become the layer's ``weight`` (its one copy),
    its steps and offsets buffers beside it, and its forward a :class:`GroupForward`. They go where the
    layer's weight was (a file's tensors are read on the CPU; a CUDA model runs them in Triton)."""
    _hold(module, weight)
    module.forward = GroupForward(module)


def _hold(module: nn.Linear, weight: GroupWeight) -> None:
    """``weight``'s tensors on ``module``, where its weight was; the forward is the caller's to set."""
    device = module.weight.device
    with torch.no_grad():
        module._parameters["weight"] = nn.Parameter(weight.values.to(device), requires_grad=False)
        module.register_buffer("weight_step", weight.step.to(device))
        module.register_buffer("weight_offset", weight.offset.to(device))
    # the outputs held: this rank's under tensor parallelism, where out_features stays the whole layer's
    module.weight_format = (weight.bits, weight.group, weight.float8, weight.out_features)


def fp8_rows(weight: torch.Tensor, row_max: RowMax | None = None) -> GroupWeight:
    """``W [N, K]`` as e4m3 codes with one float32 scale per output row (one group of the whole row).
    ``row_max``: each row's ``max|W|`` over the whole row where ``weight`` is a row-split shard's slice
    (the maximum over every rank), so each rank holds its slice of the single-process codes."""
    w = weight.detach().float()
    k = w.shape[1]
    if k % 2:
        raise WeightQuantError(
            f"model.quantization: fp8 packs rows of an even length; a linear of {k} inputs is not one: use int8"
        )
    scale = row_scales(w, E4M3_MAX, row_max)
    codes = (w / scale[:, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    d = scale[:, None].contiguous()
    return GroupWeight.pack(codes, d, torch.zeros_like(d), 8, k, float8=True)


def install_fp8_rows(module: nn.Linear, weight: torch.Tensor, row_max: RowMax | None) -> GroupForward:
    """FP8 on load for one linear (:func:`bm.runtime.weight_quant.quantize_linears`'s quantizer): its
    ``weight`` (this rank's slice) held as :func:`fp8_rows`; returns the forward to run it."""
    _hold(module, fp8_rows(weight, row_max))
    return GroupForward(module)


def group_weight(module: nn.Linear) -> GroupWeight:
    """A group linear's :class:`GroupWeight`, from the module's own tensors (moved with it)."""
    bits, group, float8, n = module.weight_format
    return GroupWeight(module.weight, module.weight_step, module.weight_offset, bits, group, n, float8)


class GroupForward(KernelForward):
    """A group linear's forward: ``x @ W.T (+ bias)`` on bm's group GEMM (the Triton one on CUDA), or in
    torch over :meth:`GroupWeight.expanded` where neither runs (the same values up to rounding)."""

    @staticmethod
    def load_kernel() -> GroupGemmKernel | None:
        return group_gemm_kernel()

    def panels(self) -> PanelWeight:
        module = self._module
        bits, group, float8, n = module.weight_format
        return PanelWeight(module.weight, module.weight_step, module.weight_offset, n, bits, group, float8)

    def bind(self, kernel: GroupGemmKernel, bias: torch.Tensor | None) -> BoundGemm:
        return kernel.bind(group_weight(self._module), bias)

    @staticmethod
    def expanded_weight(module: nn.Linear) -> torch.Tensor:
        return group_weight(module).expanded()

    @staticmethod
    def torch_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        bias = None if module.bias is None else module.bias.float()
        return torch.nn.functional.linear(x.float(), group_weight(module).expanded(), bias).to(x.dtype)
