"""Prepacked linear weights (bm.runtime.prepack): same results as nn.Linear, only inside a bm forward."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from bm.config import ConfigError, load_config
from bm.runtime import prepack
from bm.runtime.attention import ShapeProbe, forward_context
from bm.runtime.native import small_gemm_kernel
from bm.runtime.prepack import (
    MAX_PACKED_ROWS,
    _PackedForward,
    prepack_linears,
    prepack_supported,
    should_prepack,
    unpack_linears,
)

pytestmark = pytest.mark.skipif(
    prepack_supported(torch.device("cpu"), torch.float32) is not None, reason="no oneDNN in this torch"
)


def in_bm_forward():
    return forward_context(ShapeProbe(), {})


class Router(nn.Linear):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return super().forward(x), x


def tiny() -> nn.Module:
    torch.manual_seed(0)
    # 50 outputs: not a whole number of the native kernel's 16-column panels
    return nn.Sequential(nn.Linear(48, 80), nn.Linear(80, 50, bias=False), Router(50, 4))


@pytest.fixture(params=["native", "onednn"])
def path(request, monkeypatch):
    """Both packed paths: bm's compiled GEMM where it builds here, and oneDNN (its fallback)."""
    if request.param == "native":
        if small_gemm_kernel() is None:
            pytest.skip("bm's compiled GEMM is not available here (no compiler or no AVX2)")
    else:
        monkeypatch.setattr(prepack, "small_gemm_kernel", lambda: None)
    return request.param


@pytest.mark.parametrize("rows", [1, 3, 7, 16, MAX_PACKED_ROWS, MAX_PACKED_ROWS + 1, 1000])
def test_packed_linear_matches_nn_linear_inside_a_bm_forward(rows, path):
    model = tiny()
    x = torch.randn(1, rows, 48)
    expected = [model[0](x), model[1](model[0](x))]
    assert prepack_linears(model) == 2  # the router overrides forward: left alone
    with torch.inference_mode(), in_bm_forward():
        got = [model[0](x), model[1](model[0](x))]
    for e, g in zip(expected, got, strict=True):
        assert g.shape == e.shape
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_the_native_packed_path_gives_each_row_the_same_result_whatever_the_batch():
    if small_gemm_kernel() is None:
        pytest.skip("bm's compiled GEMM is not available here")
    model = tiny()
    prepack_linears(model)
    x = torch.randn(37, 48)
    with torch.inference_mode(), in_bm_forward():
        batch = model[0](x)
        for i in (0, 5, 36):
            assert torch.equal(model[0](x[i : i + 1]), batch[i : i + 1])


def test_outside_a_bm_forward_a_packed_layer_computes_exactly_as_transformers_does():
    model = tiny()
    x = torch.randn(5, 48)
    expected = model[0](x)
    prepack_linears(model)
    with torch.inference_mode():
        assert torch.equal(model[0](x), expected)


def test_a_weight_changed_in_place_after_packing_is_packed_again(path):
    model = tiny()
    prepack_linears(model)
    x = torch.randn(4, 48)
    with torch.no_grad():
        model[0].weight.mul_(2)
    reference = nn.functional.linear(x, model[0].weight, model[0].bias)
    with torch.inference_mode(), in_bm_forward():
        torch.testing.assert_close(model[0](x), reference, rtol=1e-5, atol=1e-5)


def test_a_prepacked_model_can_be_deep_copied_and_the_copy_uses_its_own_weights(path):
    model = tiny()
    prepack_linears(model)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        clone[0].weight.zero_()
        clone[0].bias.fill_(1.0)
    x = torch.randn(2, 48)
    with torch.inference_mode(), in_bm_forward():
        assert torch.equal(clone[0](x), torch.ones(2, 80))
        assert not torch.equal(model[0](x), torch.ones(2, 80))
    assert isinstance(clone[0].forward, _PackedForward)


def test_unpack_restores_the_modules_own_forward():
    model = tiny()
    prepack_linears(model)
    unpack_linears(model)
    assert not any(isinstance(m.forward, _PackedForward) for m in model.modules() if isinstance(m, nn.Linear))


def test_prepack_modes():
    model = tiny()
    cpu = torch.device("cpu")
    assert should_prepack("off", model, cpu, torch.float32) is False
    assert should_prepack("auto", model, cpu, torch.float32) is True
    assert should_prepack("auto", model, cpu, torch.float16) is False
    with pytest.raises(
        ValueError, match=r"model\.prepack is on, but .*float16.*set model\.prepack to auto or off"
    ):
        should_prepack("on", model, cpu, torch.float16)


def test_model_prepack_config_takes_auto_on_off_and_yaml_booleans(tmp_path):
    for value, expected in (("auto", "auto"), ("ON", "on"), (False, "off"), (True, "on")):
        assert load_config(None, {"model.prepack": value}).model.prepack == expected
    with pytest.raises(ConfigError, match=r"model\.prepack: unknown value 'maybe'; allowed: auto, off, on"):
        load_config(None, {"model.prepack": "maybe"})
