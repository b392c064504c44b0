"""Where a model's linear weights come from, decided once per load: ``model.quantization`` against what
the model is stored as. The one place the loader asks, so every scheme is resolved, and every mismatch
refused, by the same rule.

* ``auto`` (the default, vLLM's ``quantization=None``): as stored. A GPTQ or AWQ int4 checkpoint's own
  weights (bm.runtime.int4_checkpoints); a GGUF preset's own blocks on the CPU in float32
  (bm.runtime.gguf_weights), their expansion elsewhere (CUDA, bf16 models, whose GEMMs multiply in bf16,
  tensor-parallel shards); any other model's full-width weights.
* ``none``: full width; ``int8``: quantized on load (bm.runtime.weight_quant). Both refused for a
  checkpoint stored quantized, which has no full-width weight to give.
* ``gguf``, ``gptq``, ``awq``: the stored format named, refused where the model is not stored so.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch import nn

from bm.runtime.gguf_weights import install_gguf_linears
from bm.runtime.int4_checkpoints import INT4_METHODS, Int4Format, install_int4_linears, int4_format
from bm.runtime.weight_quant import WeightQuantError, quantize_linears

Install = Callable[[nn.Module], int]


def preset_gguf(preset: str | None) -> Path | None:
    """The GGUF file a preset's checkpoint is converted from (bm.runtime.presets), or None for any other
    model (and for a preset whose package is not installed: its conversion names that first)."""
    from bm.preset_files import PRESETS, gguf_file

    found = PRESETS.get(preset) if preset else None
    return gguf_file(found) if found is not None else None


def stored_quantization(path: Path) -> Int4Format | None:
    """The int4 format a checkpoint directory is saved in (config.json's ``quantization_config``), None
    for a full-width one; :class:`WeightQuantError` for a format bm does not read (FP8,
    compressed-tensors, bitsandbytes, ...), before transformers tries that format's own packages."""
    try:
        quant = json.loads((path / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError):
        return None  # from_pretrained reports an unreadable config in its own words
    if not quant:
        return None
    return int4_format(path, quant if isinstance(quant, dict) else {})


def weight_source(
    quantization: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    sharded: bool,
    gguf: Path | None = None,
    checkpoint: Path | None = None,
    int4: Int4Format | None = None,
) -> tuple[str, Install]:
    """The scheme that runs (none, int8, gguf, gptq, awq) and what installs it in a loaded model: a GGUF
    preset's file (``gguf``), or a checkpoint directory stored in ``int4``."""
    if int4 is not None:
        if quantization not in ("auto", int4.method):
            raise WeightQuantError(
                f"model.path {str(checkpoint)!r} is a {int4.method} int4 checkpoint, which model.quantization: "
                f"{quantization} does not read (it stores no full-width weights): set model.quantization: auto "
                f"(or {int4.method})"
            )
        if device.type != "cpu" or sharded:
            raise WeightQuantError(
                f"model.path {str(checkpoint)!r}: {int4.method} int4 weights run on bm's CPU group GEMM, one "
                "process per model (no CUDA kernel, no tensor-parallel shards yet): set model.device: cpu"
            )
        return int4.method, partial(install_int4_linears, path=checkpoint, fmt=int4)
    if quantization in INT4_METHODS:
        raise WeightQuantError(
            f"model.quantization: {quantization} reads a {quantization} int4 checkpoint; this model is not "
            "one: set model.quantization: auto"
        )
    if gguf is not None and sharded:
        gguf = None  # the blocks run unsharded layers only: the float32 expansion is sharded
    if quantization == "auto":
        native = gguf is not None and device.type == "cpu" and dtype == torch.float32
        quantization = "gguf" if native else "none"
    if quantization == "gguf":
        if gguf is None:
            raise WeightQuantError(
                "model.quantization: gguf runs a GGUF preset's own blocks, on the CPU and unsharded: set "
                "model.quantization: auto or none here"
            )
        return "gguf", lambda model: sum(install_gguf_linears(model, gguf).values())
    return quantization, partial(quantize_linears, scheme=quantization)
