"""Linears whose weight is a :class:`GroupWeight` (small integers in groups, each with a float32 step and
offset), run by bm's group GEMM: what the GGUF reader (bm.runtime.gguf_weights) and the reader of checkpoints
stored quantized (bm.runtime.stored_checkpoints: GPTQ, AWQ, FP8) give a layer. The module stays the same ``nn.Linear`` (its name and
hooks stay); ``weight`` holds the packed values, ``weight_step`` and ``weight_offset`` the groups'
parameters, and ``forward`` a :class:`GroupForward`."""

from __future__ import annotations

import torch
from torch import nn

from bm.runtime.native import GroupGemmKernel, GroupWeight, group_gemm_kernel
from bm.runtime.weight_quant import KernelForward, PanelWeight


def install_group_weight(module: nn.Linear, weight: GroupWeight) -> None:
    """Make ``module`` run ``weight``: its packed values become the layer's ``weight`` (its one copy),
    its steps and offsets buffers beside it, and its forward a :class:`GroupForward`. They go where the
    layer's weight was (a file's tensors are read on the CPU; a CUDA model runs them in Triton)."""
    device = module.weight.device
    with torch.no_grad():
        module._parameters["weight"] = nn.Parameter(weight.values.to(device), requires_grad=False)
        module.register_buffer("weight_step", weight.step.to(device))
        module.register_buffer("weight_offset", weight.offset.to(device))
    module.weight_format = (weight.bits, weight.group, weight.float8)
    module.forward = GroupForward(module)


def group_weight(module: nn.Linear) -> GroupWeight:
    """A group linear's :class:`GroupWeight`, from the module's own tensors (moved with it)."""
    bits, group, float8 = module.weight_format
    return GroupWeight(
        module.weight, module.weight_step, module.weight_offset, bits, group, module.out_features, float8
    )


class GroupForward(KernelForward):
    """A group linear's forward: ``x @ W.T (+ bias)`` on bm's group GEMM (the Triton one on CUDA), or in
    torch over :meth:`GroupWeight.expanded` where neither runs (the same values up to rounding)."""

    @staticmethod
    def load_kernel() -> GroupGemmKernel | None:
        return group_gemm_kernel()

    def panels(self) -> PanelWeight:
        module = self._module
        bits, group, float8 = module.weight_format
        return PanelWeight(
            module.weight, module.weight_step, module.weight_offset, module.out_features, bits, group, float8
        )

    def run(self, kernel: GroupGemmKernel, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return kernel(x, group_weight(self._module), bias)

    @staticmethod
    def expanded_weight(module: nn.Linear) -> torch.Tensor:
        return group_weight(module).expanded()

    @staticmethod
    def torch_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        bias = None if module.bias is None else module.bias.float()
        return torch.nn.functional.linear(x.float(), group_weight(module).expanded(), bias).to(x.dtype)
