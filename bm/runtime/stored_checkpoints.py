"""A checkpoint directory saved quantized (config.json's ``quantization_config``), read as stored: which
format it is, and each quantized linear's stored tensors given to the layer as a :class:`GroupWeight`
(bm's group GEMM), never a full-width weight.

The formats and their decoders live beside this module: GPTQ and AWQ int4
(bm.runtime.int4_checkpoints), FP8 (bm.runtime.fp8_checkpoints). Anything else (bitsandbytes, other
compressed-tensors schemes, HQQ, ...) is refused by name, before transformers tries that format's own
packages.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bm.runtime.fp8_checkpoints import Fp8Format, decode_fp8, fp8_format
from bm.runtime.group_linears import install_group_weight
from bm.runtime.int4_checkpoints import Int4Format, decode_int4, int4_format
from bm.runtime.native import GroupWeight
from bm.runtime.weight_quant import WeightQuantError, quantized_linears

StoredFormat = Int4Format | Fp8Format
# model.quantization's name for each stored method (vLLM's names)
SCHEMES = {"gptq": "gptq", "awq": "awq", "fp8": "fp8", "compressed-tensors": "compressed-tensors"}


def load_stored_checkpoint(path: Path, **kwargs: Any) -> nn.Module:
    """transformers' model of a checkpoint stored quantized, built without its quantization_config:
    transformers then loads its plain tensors (embeddings, norms, the head) and leaves the quantized
    linears for :func:`install_stored_linears` (it would otherwise ask for the format's kernel packages,
    or expand the weights to full width). ``kwargs`` go to ``from_pretrained``."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    del config.quantization_config
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the stored tensors are "unexpected", the linears' weights "missing"
    try:
        return AutoModelForCausalLM.from_pretrained(path, config=config, **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)


def stored_format(path: Path, quant: dict[str, Any]) -> StoredFormat:
    """The format of the checkpoint at ``path`` from its ``quantization_config``, or
    :class:`WeightQuantError` naming what bm does not read."""
    return fp8_format(path, quant) or int4_format(path, quant)


def _parts(fmt: StoredFormat) -> tuple[str, ...]:
    """The stored tensors of one quantized linear, the first marking it as quantized."""
    if isinstance(fmt, Fp8Format):
        return (fmt.scale_name, "weight")
    return ("qweight", "qzeros", "scales")


def _decode(fmt: StoredFormat, tensors: dict[str, torch.Tensor]) -> GroupWeight:
    if isinstance(fmt, Fp8Format):
        return decode_fp8(fmt, tensors["weight"], tensors[fmt.scale_name])
    return decode_int4(fmt, tensors["qweight"], tensors["qzeros"], tensors["scales"])


def install_stored_linears(model: nn.Module, path: Path, fmt: StoredFormat) -> int:
    """Give ``model``'s linears the checkpoint's stored quantized weights (transformers loaded the model
    without its quantization_config: its plain tensors only); returns how many. A linear with neither
    its quantized tensors nor a ``weight`` stored is refused (transformers would have left it random)."""
    from safetensors import safe_open

    with ExitStack() as stack:  # each file opened once, its index read once
        opened = [stack.enter_context(safe_open(file, framework="pt")) for file in _weight_files(path)]
        where = {key: f for f in opened for key in f.keys()}  # noqa: SIM118 (a safe_open, not a dict)
        return _install_all(model, path, fmt, where)


def _install_all(model: nn.Module, path: Path, fmt: StoredFormat, where: dict[str, Any]) -> int:
    parts = _parts(fmt)
    count = 0
    for name, module in quantized_linears(model):
        if f"{name}.{parts[0]}" not in where:
            if f"{name}.weight" not in where:
                raise WeightQuantError(f"model.path {str(path)!r}: {name} has no weight stored")
            continue  # stored full width (modules_to_not_convert, the head): transformers loaded it
        if type(module.weight.data) is not torch.Tensor:
            raise WeightQuantError(
                f"model.quantization: {fmt.method} runs unsharded linears; {name} is sharded (tensor parallelism)"
            )
        tensors = {}
        for part in parts:
            key = f"{name}.{part}"
            if key not in where:
                raise WeightQuantError(f"model.path {str(path)!r}: {key} is missing")
            tensors[part] = where[key].get_tensor(key)
        weight = _decode(fmt, tensors)
        if (weight.out_features, weight.step.shape[1] * weight.group) != tuple(module.weight.shape):
            raise WeightQuantError(
                f"model.path {str(path)!r}: {name}'s stored weight is {weight.out_features} x "
                f"{weight.step.shape[1] * weight.group}, the model's {tuple(module.weight.shape)}"
            )
        install_group_weight(module, weight)
        count += 1
    if count == 0:
        raise WeightQuantError(
            f"model.path {str(path)!r}: a {fmt.method} checkpoint with no quantized linear"
        )
    return count


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    single = path / "model.safetensors"
    if not single.is_file():
        raise WeightQuantError(
            f"model.path {str(path)!r}: no model.safetensors (bm reads stored weights from safetensors)"
        )
    return [single]
