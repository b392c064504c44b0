"""A GGUF file's own blocks as the weights of bm's linears (``model.quantization: gguf``, which ``auto``
picks for a float32 model on the CPU from a GGUF file: the preset's, or ``model.path``'s): Q4_0, Q4_1 and
Q8_0, run by bm's group GEMM without expanding them, so a 4-bit file's decoder reads about a fifth of
float32's bytes.

The model is first built from the checkpoint converted once from the same file (bm.runtime.presets:
transformers' own reading, every tensor expanded to float32). Then each decoder linear whose GGUF tensor
is one of these block formats takes the blocks instead:

* Q4_0 block: float16 ``d``, 32 nibbles ``u``; ``w = d * (u - 8)``, stored as ``u * d + (-8 d)``.
* Q4_1 block: float16 ``d`` and ``m``, 32 nibbles; ``w = u * d + m``.
* Q8_0 block: float16 ``d``, 32 int8 ``u``; ``w = u * d``, stored as ``u * d + 0``.

(A block's byte ``j`` holds its elements ``j`` (low nibble) and ``j + 16`` (high).) Every ``u * d`` is
exact in float32, so each weight is the one value gguf's ``dequantize`` gives, which is what
transformers loaded. A layer whose blocks, expanded, are not bit for bit the converted checkpoint's
weight (a name or row order read wrongly, an architecture transformers reads its own way) stops the
load: the native path never runs other weights than the reference's. Tensors stored full width (F32,
F16, BF16) keep the converted weight, as the embedding and output head always do
(:func:`quantized_linears`); other block formats (K-quants) are refused by name.

llama.cpp's converter stores a Llama's q and k projections with their rows permuted for its rotary
layout; transformers undoes it on load (its ``LlamaTensorProcessor``), and so is done here, on the rows
(a block lies along a row, so a row permutation keeps blocks whole).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from bm.runtime.gguf_index import GgufIndexError, read_gguf_index
from bm.runtime.group_linears import install_group_weight
from bm.runtime.native import GroupWeight
from bm.runtime.weight_quant import WeightQuantError, quantized_linears

BLOCK = 32  # elements per block of every format read here
# format -> (bits of u, bytes of the block's float16 fields)
FORMATS = {"Q4_0": (4, 2), "Q4_1": (4, 4), "Q8_0": (8, 2)}
# architectures whose q/k rows llama.cpp permutes (transformers' TENSOR_PROCESSORS["llama"])
_PERMUTED_QK = frozenset({"llama"})


def decode_blocks(raw: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GGUF tensor's rows of blocks (uint8 ``[N, K / 32 * block bytes]``) -> ``u [N, K]``, ``d`` and
    ``m`` ``[N, K / 32]`` float32, with ``W = u * d + m``."""
    bits, head = FORMATS[kind]
    size = head + (BLOCK // 2 if bits == 4 else BLOCK)
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, size)
    d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
    body = blocks[..., head:]
    if bits == 4:
        u = torch.cat((body & 0x0F, body >> 4), -1).reshape(n, -1)  # elements j and j + 16 of byte j
        m = (
            blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
            if kind == "Q4_1"
            else -8 * d
        )
    else:
        u = body.contiguous().view(torch.int8).reshape(n, -1)
        m = torch.zeros_like(d)
    return u, d, m


def _rotary_rows(n: int, heads: int) -> torch.Tensor:
    """The row order undoing llama.cpp's q/k permutation of ``n`` rows over ``heads`` heads."""
    half = n // heads // 2
    return torch.arange(n).reshape(heads, half, 2).transpose(1, 2).reshape(n)


def install_gguf_linears(model: nn.Module, gguf_file: Path) -> dict[str, int]:
    """Give ``model``'s decoder linears their blocks from ``gguf_file``; returns how many layers took
    each format (none: every tensor is stored full width)."""
    import gguf

    try:
        arch, tensors = read_gguf_index(gguf_file)
    except GgufIndexError as exc:
        raise WeightQuantError(f"model.quantization: gguf: {exc}: set model.quantization: none") from None
    known = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    if arch not in known:
        raise WeightQuantError(
            f"model.quantization: gguf: {gguf_file.name}'s architecture {arch!r} is unknown to the gguf "
            "package: set model.quantization: none to run its float32 expansion"
        )
    config = model.config.get_text_config()
    names = gguf.get_tensor_name_map(known[arch], config.num_hidden_layers)
    counts: dict[str, int] = {}
    for name, module in quantized_linears(model):
        key = names.get_name(name + ".weight", try_suffixes=(".weight",))
        tensor = tensors.get(key) if key else None
        kind = tensor.kind if tensor is not None else None
        if kind not in FORMATS:
            if kind is not None and kind not in ("F32", "F16", "BF16"):
                raise WeightQuantError(
                    f"model.quantization: gguf runs Q4_0, Q4_1 and Q8_0 blocks; {key} in {gguf_file.name} is "
                    f"{kind}: set model.quantization: none to run the file's float32 expansion"
                )
            continue  # stored full width (or not in the file): the converted weight is the file's own
        if type(module.weight.data) is not torch.Tensor:
            raise WeightQuantError(
                f"model.quantization: gguf runs unsharded linears; {name} is sharded: set "
                "model.quantization: none under tensor parallelism"
            )
        u, d, m = decode_blocks(torch.from_numpy(tensor.data.copy()), kind)
        if arch in _PERMUTED_QK and key.split(".")[-2] in ("attn_q", "attn_k"):
            heads = (
                config.num_attention_heads if key.split(".")[-2] == "attn_q" else config.num_key_value_heads
            )
            rows = _rotary_rows(u.shape[0], heads)
            u, d, m = u[rows], d[rows], m[rows]
        weight = GroupWeight.pack(u, d, m, FORMATS[kind][0], BLOCK)
        expanded = weight.expanded()
        if expanded.shape != module.weight.shape or not torch.equal(
            expanded.to(module.weight.dtype), module.weight.detach()
        ):
            raise WeightQuantError(
                f"model.quantization: gguf: {key}'s blocks in {gguf_file.name}, expanded, are not the weight "
                f"of {name} converted from the same file: set model.quantization: none"
            )
        install_group_weight(module, weight)
        counts[kind] = counts.get(kind, 0) + 1
    return counts
