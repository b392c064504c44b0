"""FP8 checkpoints read as they are stored (``model.quantization: auto``, or vLLM's
``quantization="fp8"``): each linear's float8 e4m3 weight and float32 scales become a
:class:`GroupWeight` for bm's group GEMM (e4m3 values, expanded in registers), never a full-width weight.

Two layouts, both ``W[n, k] = e4m3[n, k] * scale`` with one rounding in float32 (the product of a 4-bit
significand and the scale), which is exactly what transformers computes when it expands them in float32:

* ``quant_method: fp8`` (transformers' fine-grained FP8, DeepSeek-V3's layout): ``weight`` e4m3 and
  ``weight_scale_inv`` float32 per block of ``weight_block_size = [bn, bk]`` (``[N / bn, K / bk]``), or
  one scale for the tensor where ``weight_block_size`` is null;
* compressed-tensors ``float-quantized`` (llm-compressor's FP8): ``weight`` e4m3 and ``weight_scale``
  per tensor (``[1]``) or per output channel (``[N, 1]``); an ``input_scale`` for static activation
  quantization is not applied (weights only: the activations stay float32).

In :class:`GroupWeight` terms: ``u`` the e4m3 byte, ``d`` the scale of its block (``m = 0``), groups of
``bk`` along k (a per-tensor or per-channel scale: one group of ``K``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bm.runtime.native import GroupWeight
from bm.runtime.weight_quant import WeightQuantError

E4M3 = torch.float8_e4m3fn


@dataclass(frozen=True)
class Fp8Format:
    """An FP8 checkpoint's layout: its scale tensor's name and, for block scales, the block."""

    method: str  # fp8 or compressed-tensors
    scale_name: str  # weight_scale_inv or weight_scale
    block: tuple[int, int] | None  # (bn, bk), or None: a scale per tensor or per output channel


def fp8_format(path: Path, quant: dict[str, Any]) -> Fp8Format | None:
    """The FP8 layout of a ``quantization_config``; None when it is no FP8 one; :class:`WeightQuantError`
    for an FP8 variant bm does not read."""
    method = str(quant.get("quant_method", "")).lower()
    where = f"model.path {str(path)!r}: a {method!r} checkpoint"
    if method == "fp8":
        block = quant.get("weight_block_size")
        return Fp8Format("fp8", "weight_scale_inv", tuple(block) if block else None)
    if method != "compressed-tensors" or quant.get("format") != "float-quantized":
        return None
    for group in (quant.get("config_groups") or {}).values():
        weights = group.get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise WeightQuantError(
                f"{where} of {weights.get('num_bits')}-bit {weights.get('type')} weights; bm reads FP8"
            )
        if weights.get("strategy") not in ("tensor", "channel"):
            raise WeightQuantError(
                f"{where} with {weights.get('strategy')!r} scales; bm reads per-tensor and per-channel FP8 scales"
            )
    return Fp8Format("compressed-tensors", "weight_scale", None)


def decode_fp8(fmt: Fp8Format, weight: torch.Tensor, scale: torch.Tensor) -> GroupWeight:
    """One linear's e4m3 ``weight [N, K]`` and its scales -> its :class:`GroupWeight`."""
    if weight.dtype != E4M3:
        raise WeightQuantError(f"{fmt.method}: a weight of {weight.dtype}, float8_e4m3fn expected")
    n, k = weight.shape
    scale = scale.float()
    if fmt.block is not None:
        bn, bk = fmt.block
        if k % bk or bk % 2 or scale.shape != (-(-n // bn), k // bk):
            raise WeightQuantError(
                f"{fmt.method}: scales {tuple(scale.shape)} for a {n} x {k} weight in {bn} x {bk} blocks"
            )
        d, group = scale.repeat_interleave(bn, 0)[:n], bk
    elif scale.numel() == 1:
        d, group = scale.reshape(1, 1).expand(n, 1), k
    elif scale.numel() == n:
        d, group = scale.reshape(n, 1), k
    else:
        raise WeightQuantError(f"{fmt.method}: scales {tuple(scale.shape)} for a {n} x {k} weight")
    u = weight.view(torch.uint8)
    return GroupWeight.pack(u, d.contiguous(), torch.zeros_like(d), 8, group, float8=True)
