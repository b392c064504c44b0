"""GPTQ and AWQ int4 checkpoints read as stored (``model.quantization: auto``): each linear's packed
values, zeros and scales become a group weight equal to ``s * (q - z)`` expanded exactly in float32, and
the oracle: greedy output equals HF generate() on that expansion (transformers has no CPU path for these
formats without their kernel packages). The checkpoints are written here by each format's layout, from
the tiny model's weights (no hub, no quantization package)."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from bm.runtime import load_model
from bm.runtime.group_linears import group_weight
from bm.runtime.model_loader import ModelConfig, ModelLoadError
from bm.runtime.weight_quant import quantized_linears
from tests.conftest import hf_greedy, reference_model
from tests.quantized_oracle import ORACLE_ENGINES, assert_greedy_equals_hf, stored_checkpoint

GROUP = 32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's GEMM layout: value j of a word is column 8c + AWQ_ORDER[j]


def _words(values: np.ndarray) -> torch.Tensor:
    """``[..., 8 * W]`` values of 0-15 -> int32 words ``[..., W]``, value j in bits 4j..4j+3."""
    v = values.astype(np.uint32).reshape(*values.shape[:-1], -1, 8)
    words = np.zeros(v.shape[:-1], dtype=np.uint32)
    for j in range(8):
        words |= v[..., j] << np.uint32(4 * j)
    return torch.from_numpy(words.view(np.int32).copy())


def _quantize(w: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``W [N, K]`` -> asymmetric 4-bit ``q [N, K]``, zeros ``z`` and float16 scales ``s`` ``[N, K / 32]``
    (zeros in 1..15, so GPTQ's original layout, which stores z - 1, holds them)."""
    groups = w.reshape(w.shape[0], -1, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    s = ((high - low) / 14).clamp_min(1e-4).half()
    z = torch.clamp(torch.round(-low / s.float()) + 1, 1, 15)
    q = torch.clamp(torch.round(groups / s.float()[..., None] + z[..., None]), 0, 15).reshape(w.shape)
    return q.to(torch.int64), z.to(torch.int64), s


def _pack(method: str, q, z, s) -> dict[str, torch.Tensor]:
    q, z = q.numpy(), z.numpy()
    if method == "awq":
        order = np.array(AWQ_ORDER)

        def interleave(cols: np.ndarray) -> np.ndarray:  # [R, N] -> the AWQ order within each 8 columns
            return cols.reshape(cols.shape[0], -1, 8)[..., order].reshape(cols.shape)

        return {
            "qweight": _words(interleave(q.T)),
            "qzeros": _words(interleave(z.T)),
            "scales": s.T.contiguous(),
        }
    offset = 1 if method == "gptq" else 0  # gptq_v2 stores z itself
    return {
        "qweight": _words(q.reshape(q.shape[0], -1, 8).transpose(1, 0, 2).reshape(q.shape[1] // 8, -1)),
        "qzeros": _words(z.T - offset),
        "scales": s.T.contiguous(),
    }


def write_int4_checkpoint(reference: torch.nn.Module, folder, method: str) -> torch.nn.Module:
    """``reference`` saved as a ``method`` (gptq, gptq_v2, awq) int4 checkpoint in ``folder``; returns
    the model it stands for: ``reference`` with each quantized weight expanded to ``s * (q - z)``."""
    expanded = copy.deepcopy(reference)
    reference.save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    linears = dict(quantized_linears(expanded))
    for i, (name, linear) in enumerate(linears.items()):
        q, z, s = _quantize(linear.weight.detach().float(), i)
        for part, tensor in _pack(method, q, z, s).items():
            tensors[f"{name}.{part}"] = tensor
        del tensors[f"{name}.weight"]
        with torch.no_grad():
            d = s.float().repeat_interleave(GROUP, 1)
            linear.weight.copy_(d * (q - z.repeat_interleave(GROUP, 1)).float())
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    quant = {"quant_method": method.split("_")[0], "bits": 4, "group_size": GROUP}
    quant.update({"awq": {"zero_point": True, "version": "gemm"}, "gptq": {"desc_act": False, "sym": False, "format": "gptq"},
                  "gptq_v2": {"desc_act": False, "sym": False, "format": "gptq_v2"}}[method])  # fmt: skip
    config["quantization_config"] = quant
    (folder / "config.json").write_text(json.dumps(config))
    return expanded


@pytest.fixture(scope="module", params=["gptq", "gptq_v2", "awq"])
def int4_case(request, tmp_path_factory, tiny_model):
    return stored_checkpoint(
        tiny_model, tmp_path_factory.mktemp(request.param), write_int4_checkpoint, request.param
    )


def test_each_linear_holds_the_checkpoints_int4_weight_expanded_exactly(int4_case):
    method, _, expanded, loaded = int4_case
    assert loaded.quantization == method.split("_")[0]
    modules = dict(loaded.model.named_modules())
    linears = quantized_linears(expanded)
    assert loaded.num_quantized_linears == len(linears) > 0
    for name, reference in linears:
        weight = group_weight(modules[name])
        assert (weight.bits, weight.group) == (4, GROUP)
        assert torch.equal(weight.expanded(), reference.weight), name
    head = loaded.model.get_output_embeddings().weight
    assert torch.equal(head, expanded.get_output_embeddings().weight)  # stored full width, kept


@ORACLE_ENGINES
def test_greedy_output_equals_hf_generate_on_the_exact_float32_expansion(int4_case, engine, tiny_reference):
    _, _, expanded, loaded = int4_case
    specs = assert_greedy_equals_hf(loaded, expanded, engine)
    # the int4 model is another model: the full-width one answers some of the same requests otherwise
    assert any(hf_greedy(expanded, p, m) != hf_greedy(tiny_reference, p, m) for p, m in specs)


def test_a_scheme_other_than_the_stored_one_and_act_order_are_refused_naming_the_fix(tmp_path, tiny_model):
    write_int4_checkpoint(reference_model(tiny_model), tmp_path, "gptq")
    for scheme in ("none", "int8", "awq"):
        with pytest.raises(
            ModelLoadError,
            match=rf"gptq checkpoint, which model\.quantization: {scheme} does not read .* set model\.quantization: auto",
        ):
            load_model(ModelConfig(path=str(tmp_path), device="cpu", quantization=scheme))
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["desc_act"] = True
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"desc_act \(act-order"):
        load_model(ModelConfig(path=str(tmp_path), device="cpu"))


def test_gptq_or_awq_named_for_a_full_width_model_is_refused():
    with pytest.raises(
        ModelLoadError, match=r"model\.quantization: awq reads awq checkpoints; this model is not one"
    ):
        load_model(ModelConfig(device="cpu", seed=0, quantization="awq"))
