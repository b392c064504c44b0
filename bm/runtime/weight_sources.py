"""Where a model's linear weights come from, decided once per load: ``model.quantization`` against what
the model is stored as. The one place the loader asks, so every scheme is resolved, and every mismatch
refused, by the same rule.

* ``auto`` (the default, vLLM's ``quantization=None``): as stored. A GPTQ, AWQ or FP8 checkpoint's own
  weights (bm.runtime.stored_checkpoints), on the CPU's group GEMM or CUDA's Triton one; a GGUF file's
  own blocks on the CPU in float32 (bm.runtime.gguf_weights; or a .gguf file in ``model.path``), their
  expansion elsewhere (bf16 models, whose GEMMs multiply in bf16; tensor-parallel shards; CUDA, until
  the Triton GEMM is measured on a GPU: ``gguf`` runs the blocks there); any other model's full-width
  weights.
* ``none``: full width; ``int8``: quantized on load (bm.runtime.weight_quant). Both refused for a
  checkpoint stored quantized, which has no full-width weight to give.
* ``fp8``: an FP8 checkpoint's own weights; on a full-width model, as vLLM's ``quantization="fp8"``
  does, its linears quantized on load to e4m3 with a scale per output row
  (bm.runtime.group_linears.install_fp8_rows; weights only, the activations stay in the model's dtype).
* ``gguf``, ``gptq``, ``awq`` and ``compressed-tensors`` (vLLM's names): the stored format named,
  refused where the model is not stored so.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch import nn

from bm.config.model import stored_scheme_mismatch
from bm.runtime.gguf_weights import install_gguf_linears
from bm.runtime.group_linears import install_fp8_rows
from bm.runtime.stored_checkpoints import SCHEMES, StoredFormat, install_stored_linears, stored_format
from bm.runtime.weight_quant import WeightQuantError, quantize_linears

Install = Callable[[nn.Module], int]


def stored_quantization(path: Path) -> StoredFormat | None:
    """The format a checkpoint directory is saved in (config.json's ``quantization_config``), None for a
    full-width one; :class:`WeightQuantError` for a format bm does not read (bitsandbytes, other
    compressed-tensors schemes, ...), before transformers tries that format's own packages."""
    try:
        quant = json.loads((path / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError):
        return None  # from_pretrained reports an unreadable config in its own words
    if not quant:
        return None
    return stored_format(path, quant if isinstance(quant, dict) else {})


def weight_source(
    quantization: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    sharded: bool,
    gguf: Path | None = None,
    checkpoint: Path | None = None,
    stored: StoredFormat | None = None,
) -> tuple[str, Install]:
    """The scheme that runs (none, int8, gguf, gptq, awq, fp8, compressed-tensors) and what installs it
    in a loaded model: a GGUF preset's file (``gguf``), or a checkpoint directory in its ``stored``
    format."""
    if stored is not None:
        scheme = SCHEMES[stored.method]
        refused = stored_scheme_mismatch(quantization, scheme, f"model.path {str(checkpoint)!r}")
        if refused:
            raise WeightQuantError(refused)
        if sharded:
            raise WeightQuantError(
                f"model.path {str(checkpoint)!r}: {scheme} weights run unsharded, one process per model (no "
                "tensor-parallel shards yet): drop --tensor-parallel"
            )
        return scheme, partial(install_stored_linears, path=checkpoint, fmt=stored)
    if quantization == "fp8":  # a full-width model: FP8 on load, as vLLM quantizes it
        return "fp8", partial(quantize_linears, scheme="fp8", quantizer=install_fp8_rows)
    if quantization in SCHEMES.values():
        raise WeightQuantError(
            f"model.quantization: {quantization} reads {quantization} checkpoints; this model is not one: "
            "set model.quantization: auto (or int8 or fp8 to quantize its full-width weights on load)"
        )
    if gguf is not None and sharded:
        gguf = None  # the blocks run unsharded layers only: the float32 expansion is sharded
    if quantization == "auto":
        native = gguf is not None and device.type == "cpu" and dtype == torch.float32
        quantization = "gguf" if native else "none"
    if quantization == "gguf":
        if gguf is None:
            raise WeightQuantError(
                "model.quantization: gguf runs a GGUF file's own blocks, on the CPU and unsharded: set "
                "model.quantization: auto or none here"
            )
        return "gguf", lambda model: sum(install_gguf_linears(model, gguf).values())
    return quantization, partial(quantize_linears, scheme=quantization)
