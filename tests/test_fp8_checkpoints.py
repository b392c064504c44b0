"""FP8 checkpoints read as stored (``model.quantization: auto``): transformers' fine-grained ``fp8``
layout (block scales) and compressed-tensors' ``float-quantized`` one (per-tensor and per-channel
scales). Each linear's e4m3 weight and scales become a group weight equal to ``e4m3 * scale`` expanded in
float32 (one rounding, as torch expands it), every e4m3 byte decoded as torch decodes it, and the oracle:
greedy output equals HF generate() on that expansion. The checkpoints are written here from the tiny
model's weights (no hub, no quantization package)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from bm.runtime import load_model
from bm.runtime.group_linears import group_weight
from bm.runtime.model_loader import ModelConfig, ModelLoadError
from bm.runtime.native import GroupWeight, group_gemm_kernel
from bm.runtime.weight_quant import quantized_linears
from tests.conftest import reference_model
from tests.native_variants import each_isa
from tests.quantized_oracle import ORACLE_ENGINES, assert_greedy_equals_hf, stored_checkpoint

E4M3 = torch.float8_e4m3fn
BLOCK = (32, 32)  # the tiny model's layers are 32-128 wide; real checkpoints use 128 x 128


@each_isa
def test_every_e4m3_byte_expands_as_torch_decodes_it_in_every_build(isa):
    """All 256 bytes (zeros, subnormals, the largest normals, both NaNs) times a scale, through the
    kernel: each output column picks one byte, so the product is that byte's value times the scale."""
    kernel = group_gemm_kernel(isa)
    if kernel is None:
        pytest.skip("bm's C kernels do not build here")
    u = torch.arange(256, dtype=torch.uint8).reshape(256, 1).expand(256, 32).contiguous()
    d = torch.full((256, 1), 0.37)
    weight = GroupWeight.pack(u, d, torch.zeros_like(d), 8, 32, float8=True)
    want = torch.arange(256, dtype=torch.uint8).view(E4M3).float() * 0.37
    nan = want.isnan()
    assert nan.sum() == 2  # 0x7f and 0xff
    x = torch.zeros(1, 32)
    x[0, 5] = 1.0  # y[n] = 1 * W[n, 5] (+ zeros)
    for got in (weight.expanded()[:, 0], kernel(x, weight, None)[0]):
        assert torch.equal(got[~nan], want[~nan]) and got[nan].isnan().all()


def _e4m3(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-448, 448).to(E4M3)


def write_fp8_checkpoint(reference: torch.nn.Module, folder, layout: str) -> torch.nn.Module:
    """``reference`` saved in an FP8 ``layout`` (fp8-block, ct-tensor, ct-channel) in ``folder``; returns
    the model it stands for: ``reference`` with each quantized weight expanded to ``e4m3 * scale``."""
    expanded = copy.deepcopy(reference)
    reference.save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    for name, linear in quantized_linears(expanded):
        w = linear.weight.detach().float()
        n, k = w.shape
        if layout == "fp8-block":
            blocks = w.reshape(-(-n // BLOCK[0]), BLOCK[0], k // BLOCK[1], BLOCK[1])
            scale = blocks.abs().amax((1, 3)) / 448
            full = scale.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)
            tensors[f"{name}.weight_scale_inv"] = scale
        elif layout == "ct-tensor":
            scale = (w.abs().amax() / 448).reshape(1)
            full = scale.expand(n, k)
            tensors[f"{name}.weight_scale"] = scale
        else:
            scale = w.abs().amax(1, keepdim=True) / 448
            full = scale.expand(n, k)
            tensors[f"{name}.weight_scale"] = scale
        q = _e4m3(w, full)
        tensors[f"{name}.weight"] = q
        with torch.no_grad():
            linear.weight.copy_(q.float() * full)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    if layout == "fp8-block":
        quant = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
    else:
        strategy = layout.split("-")[1]
        weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True}
        quant = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
            "ignore": ["lm_head"],
        }
    config["quantization_config"] = quant
    (folder / "config.json").write_text(json.dumps(config))
    return expanded


@pytest.fixture(scope="module", params=["fp8-block", "ct-tensor", "ct-channel"])
def fp8_case(request, tmp_path_factory, tiny_model):
    return stored_checkpoint(
        tiny_model, tmp_path_factory.mktemp(request.param), write_fp8_checkpoint, request.param
    )


def test_each_linear_holds_the_checkpoints_fp8_weight_expanded_as_torch_does(fp8_case):
    layout, _, expanded, loaded = fp8_case
    assert loaded.quantization == ("fp8" if layout == "fp8-block" else "compressed-tensors")
    modules = dict(loaded.model.named_modules())
    linears = quantized_linears(expanded)
    assert loaded.num_quantized_linears == len(linears) > 0
    for name, reference in linears:
        weight = group_weight(modules[name])
        assert weight.float8 and weight.bits == 8
        assert weight.group == (BLOCK[1] if layout == "fp8-block" else reference.in_features)
        assert torch.equal(weight.expanded(), reference.weight), name


@ORACLE_ENGINES
def test_greedy_output_equals_hf_generate_on_the_float32_expansion(fp8_case, engine):
    _, _, expanded, loaded = fp8_case
    assert_greedy_equals_hf(loaded, expanded, engine)


def test_an_fp8_variant_bm_does_not_read_is_refused_by_name(tmp_path, tiny_model):
    write_fp8_checkpoint(reference_model(tiny_model), tmp_path, "ct-channel")
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "block"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ModelLoadError, match=r"'block' scales; bm reads per-tensor and per-channel FP8 scales"
    ):
        load_model(ModelConfig(path=str(tmp_path), device="cpu"))


def test_a_stored_checkpoint_is_refused_under_tensor_parallel_replicas_before_its_weights_load(
    tmp_path, tiny_reference, monkeypatch
):
    """With several replicas each rank loads the whole model and splits it after (_shard_replica), so
    it is a shard all the same: an FP8 checkpoint, which runs unsharded, is refused there as under one
    replica, and before any weight is read (this folder has none)."""
    from bm.parallel import layout

    tiny_reference.config.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(layout._state, "layout", layout.ParallelLayout(tensor_parallel=2, data_parallel=2))
    with pytest.raises(ModelLoadError, match=r"fp8 weights run unsharded.*drop --tensor-parallel"):
        load_model(ModelConfig(path=str(tmp_path), device="cpu"))


def test_a_scheme_the_model_is_not_stored_in_is_refused_before_its_weights_load(tmp_path, tiny_reference):
    tiny_reference.config.save_pretrained(tmp_path)  # a config and no weights: a load would fail first
    with pytest.raises(ModelLoadError, match=r"model.quantization: gptq reads gptq checkpoints"):
        load_model(ModelConfig(path=str(tmp_path), device="cpu", quantization="gptq"))
