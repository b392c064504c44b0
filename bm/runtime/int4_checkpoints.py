"""GPTQ and AWQ int4 checkpoints read as they are stored (``model.quantization: auto``, or vLLM's
``quantization="gptq"`` / ``"awq"``): each quantized linear's packed 4-bit values, zeros and float16
scales become a :class:`GroupWeight` for bm's group GEMM (installed by bm.runtime.stored_checkpoints),
never a full-width weight.

Both formats store, per linear ``W [N, K]`` and group ``g`` of ``group_size`` inputs, a float16 scale
``s`` and a 4-bit zero ``z`` per output, and 4-bit values ``q``: ``W[n, k] = s * (q - z)``. Here that
is ``u * d + m`` with ``u = q``, ``d = s`` and ``m = -z * s``; every term is exact in float32 (a 4- or
5-bit integer times an 11-bit significand), so each weight is exactly ``s * (q - z)`` in float32, the
reference the oracle runs (transformers has no CPU path for these formats without their kernels'
packages, so the issue's reference is the same integers and scales expanded exactly to float32).

The layouts (int32 words, value ``j`` of a word in bits ``4j .. 4j + 3``):

* GPTQ (``quant_method: gptq``): ``qweight [K / 8, N]``, word ``[r, n]`` holding ``q[8r + j, n]``;
  ``qzeros [K / group, N / 8]``, word ``[g, c]`` holding ``z[g, 8c + j]``, minus one in the original
  format (``format``/``checkpoint_format`` ``gptq``; ``gptq_v2`` stores ``z`` itself); ``scales
  [K / group, N]``. Act-order checkpoints (``desc_act: true``, groups not contiguous in k) are refused.
* AWQ (``quant_method: awq``, the GEMM layout): ``qweight [K, N / 8]``, word ``[k, c]`` holding
  ``q[k, 8c + ORDER[j]]`` with ``ORDER = 0, 2, 4, 6, 1, 3, 5, 7``; ``qzeros [K / group, N / 8]`` the same
  way; ``scales [K / group, N]``.

A linear stored with a plain ``weight`` (the output head, ``modules_to_not_convert``) keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bm.runtime.native import GroupWeight
from bm.runtime.weight_quant import WeightQuantError

INT4_METHODS = ("gptq", "awq")
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True)
class Int4Format:
    """A checkpoint's ``quantization_config``, as far as reading its weights needs it."""

    method: str  # gptq or awq
    group_size: int  # -1: one group per row
    zero_offset: int  # added to each stored zero (GPTQ's original format stores z - 1)


def int4_format(path: Path, quant: dict[str, Any]) -> Int4Format:
    """The format of the checkpoint at ``path`` from its ``quantization_config``, or
    :class:`WeightQuantError` naming what bm does not read."""
    method = str(quant.get("quant_method", "")).lower()
    where = f"model.path {str(path)!r}: a {method!r} checkpoint"
    if method not in INT4_METHODS:
        raise WeightQuantError(
            f"{where}; bm reads GPTQ and AWQ int4 and FP8 checkpoints (and int8 or fp8 on load from a full-width "
            "one): use a full-width checkpoint, with model.quantization: int8 or fp8 to quantize it on load"
        )
    bits = quant.get("bits", quant.get("w_bit"))
    if bits != 4:
        raise WeightQuantError(f"{where} of {bits}-bit weights; bm reads 4-bit ones")
    group = int(quant.get("group_size", quant.get("q_group_size", 128)))
    if method == "gptq":
        if quant.get("desc_act"):
            raise WeightQuantError(
                f"{where} with desc_act (act-order: groups not contiguous in k); bm reads desc_act: false ones"
            )
        fmt = quant.get("format") or quant.get("checkpoint_format") or "gptq"
        if fmt not in ("gptq", "gptq_v2"):
            raise WeightQuantError(f"{where} in the {fmt!r} layout; bm reads the gptq and gptq_v2 layouts")
        return Int4Format("gptq", group, 1 if fmt == "gptq" else 0)
    version = str(quant.get("version", "gemm")).lower()
    if version != "gemm" or not quant.get("zero_point", True):
        raise WeightQuantError(
            f"{where} of version {version!r}, zero_point {quant.get('zero_point')}; bm reads GEMM"
        )
    return Int4Format("awq", group, 0)


def _unpack(words: torch.Tensor) -> torch.Tensor:
    """int32 words ``[..., W]`` -> their eight 4-bit values ``[..., W, 8]`` (value j in bits 4j..4j+3)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return (words.unsqueeze(-1) >> shifts) & 0xF


def decode_int4(
    fmt: Int4Format, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
) -> GroupWeight:
    """One linear's stored tensors -> its :class:`GroupWeight` (``u = q``, ``d = s``, ``m = -z * s``)."""
    if fmt.method == "gptq":
        q = _unpack(qweight.transpose(0, 1)).reshape(qweight.shape[1], -1)  # [N, K]
        z = _unpack(qzeros).reshape(qzeros.shape[0], -1)  # [K / group, N]
    else:
        order = torch.tensor(_AWQ_ORDER).argsort()  # value j of a word is column 8c + ORDER[j]
        q = _unpack(qweight)[..., order].reshape(qweight.shape[0], -1).transpose(0, 1)  # [N, K]
        z = _unpack(qzeros)[..., order].reshape(qzeros.shape[0], -1)
    n, k = q.shape
    group = k if fmt.group_size == -1 else fmt.group_size
    if z.shape != (k // group, n) or scales.shape != (k // group, n) or k % group:
        raise WeightQuantError(
            f"{fmt.method}: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and scales "
            f"{tuple(scales.shape)} do not make one weight in groups of {group}"
        )
    d = scales.float().transpose(0, 1).contiguous()
    m = -(z + fmt.zero_offset).float().transpose(0, 1) * d
    return GroupWeight.pack(q, d, m, 4, group)
