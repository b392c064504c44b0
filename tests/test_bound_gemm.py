"""A quantized linear's CPU forward binds its kernel to the layer's tensors once (bm.runtime.native.args
.BoundGemm): each call then checks only its input. These pin that the bound call computes what the
unbound kernel computes for every input layout, and that a layer whose tensors change is bound again."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from bm.runtime.group_linears import install_fp8_rows, install_group_weight
from bm.runtime.native import GroupWeight, group_gemm_kernel, int8_gemm_kernel
from bm.runtime.weight_quant import Int8Forward, Int8GemmKernel, quantize_weight


def _int8_linear(n: int, k: int, bias: bool) -> nn.Linear:
    linear = nn.Linear(k, n, bias=bias)
    q, scale = quantize_weight(linear.weight)
    linear._parameters["weight"] = nn.Parameter(Int8GemmKernel.pack(q), requires_grad=False)
    linear.register_buffer("weight_scale", scale)
    linear.forward = Int8Forward(linear)
    return linear


def _q4_linear(n: int, k: int, bias: bool) -> nn.Linear:
    g = torch.Generator().manual_seed(1)
    linear = nn.Linear(k, n, bias=bias)
    d = torch.rand(n, k // 32, generator=g) / 50
    install_group_weight(
        linear,
        GroupWeight.pack(
            torch.randint(0, 16, (n, k), generator=g), d, torch.randn(d.shape, generator=g), 4, 32
        ),
    )
    return linear


def _fp8_linear(n: int, k: int, bias: bool) -> nn.Linear:
    linear = nn.Linear(k, n, bias=bias)
    linear.forward = install_fp8_rows(linear, linear.weight.detach(), None)
    return linear


def _unbound(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The same layer through the kernel's unbound call, which checks everything every time."""
    from bm.runtime.group_linears import group_weight

    bias = None if linear.bias is None else linear.bias.detach().float()
    if isinstance(linear.forward, Int8Forward):
        return int8_gemm_kernel()(x, linear.weight, linear.weight_scale, bias)
    return group_gemm_kernel()(x, group_weight(linear), bias)


LINEARS = pytest.mark.parametrize("make", [_int8_linear, _q4_linear, _fp8_linear], ids=["int8", "q4", "fp8"])


@pytest.fixture(autouse=True)
def _kernels_built():
    if group_gemm_kernel() is None or int8_gemm_kernel() is None:
        pytest.skip("bm's C kernels do not build here")


@LINEARS
def test_the_bound_call_gives_the_unbound_kernels_bits_for_every_input_layout(make):
    linear = make(40, 64, True)
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(7, 3 * 64, generator=g)
    inputs = {
        "2d": torch.randn(5, 64, generator=g),
        "3d": torch.randn(2, 3, 64, generator=g),
        "one row": torch.randn(1, 1, 64, generator=g),
        "strided rows": wide[:, 64:128],  # a row stride of 192: read in place, not copied
        "transposed": torch.randn(64, 6, generator=g).t(),  # columns not unit-stride: copied first
        "no rows": torch.randn(0, 64, generator=g),
    }
    with torch.inference_mode():
        for name, x in inputs.items():
            got = linear(x)
            assert got.shape == (*x.shape[:-1], 40), name
            assert torch.equal(got, _unbound(linear, x.contiguous()).reshape(got.shape)), name
        bf16 = inputs["3d"].bfloat16()
        assert torch.equal(linear(bf16), _unbound(linear, bf16.float()).to(torch.bfloat16))


@LINEARS
def test_a_layer_is_bound_once_and_again_when_a_tensor_is_replaced(make):
    linear = make(24, 32, True)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        before = linear(x)
        bound = linear.forward._bound
        assert torch.equal(linear(x), before) and linear.forward._bound is bound  # bound once
    with torch.no_grad():
        linear.bias.add_(1.0)  # in place: the kernel reads the tensor itself, so the binding stands
    with torch.inference_mode():
        assert torch.equal(linear(x), _unbound(linear, x)) and not torch.equal(linear(x), before)
        assert linear.forward._bound is bound
    aux = "weight_scale" if "weight_scale" in linear._buffers else "weight_step"
    linear.register_buffer(aux, linear._buffers[aux] * 2)  # replaced: another address
    with torch.inference_mode():
        assert torch.equal(linear(x), _unbound(linear, x)) and linear.forward._bound is not bound


def test_a_bias_of_another_dtype_changed_in_place_is_bound_again():
    """A bf16 layer's bias is bound as a float32 copy, so its version is watched."""
    linear = _q4_linear(24, 32, True)
    linear.bias = nn.Parameter(
        linear.bias.detach().bfloat16(), requires_grad=False
    )  # as a bf16 model holds it
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(5)).bfloat16()
    with torch.inference_mode():
        before = linear(x)
    with torch.no_grad():
        linear.bias.add_(1.0)
    with torch.inference_mode():
        after = linear(x)
    assert torch.equal(after, _unbound(linear, x.float()).to(torch.bfloat16)) and not torch.equal(
        after, before
    )


@LINEARS
def test_a_deep_copy_binds_its_own_tensors(make):
    linear = make(16, 32, False)
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        linear(x)
        clone = copy.deepcopy(linear)
        with torch.no_grad():
            clone._buffers["weight_scale" if "weight_scale" in clone._buffers else "weight_step"].mul_(3)
        assert torch.equal(clone(x), _unbound(clone, x)) and not torch.equal(clone(x), linear(x))


def test_an_input_of_the_wrong_width_is_refused_naming_it():
    linear = _q4_linear(16, 64, False)
    with (
        torch.inference_mode(),
        pytest.raises(ValueError, match=r"group GEMM: x \(2, 32\).*rows of 64 expected"),
    ):
        linear(torch.zeros(2, 32))


def test_a_packed_float32_linear_binds_its_gemm_and_binds_again_after_a_repack():
    """bm.runtime.prepack's float32 linears run the same bound call inside a bm forward."""
    from bm.runtime.attention import forward_context
    from bm.runtime.native import small_gemm_kernel
    from bm.runtime.prepack import prepack_linears

    kernel = small_gemm_kernel()
    if kernel is None:
        pytest.skip("bm's C kernels do not build here")
    g = torch.Generator().manual_seed(6)
    linear = nn.Linear(64, 40)
    prepack_linears(nn.Sequential(linear), "onednn")
    inputs = [
        torch.randn(5, 64, generator=g),
        torch.randn(2, 3, 64, generator=g),
        torch.randn(64, 6, generator=g).t(),
    ]
    with torch.inference_mode(), forward_context(object(), None):
        for x in inputs:
            expected = kernel(x.contiguous(), kernel.pack(linear.weight), linear.bias, 40)
            assert torch.equal(linear(x), expected)
        bound = linear.forward._bound
    with torch.no_grad():
        linear.weight.mul_(2)  # packed again on the next call: another packed tensor to bind
    with torch.inference_mode(), forward_context(object(), None):
        x = inputs[0]
        assert torch.equal(linear(x), kernel(x, kernel.pack(linear.weight), linear.bias, 40))
        assert linear.forward._bound is not bound


@LINEARS
def test_a_row_alone_gets_the_bits_it_gets_in_a_batch(make):
    """A single row runs its own tile (both panels of a pair at once, group formats on AVX2): each
    output is still the batch's chain, so batch invariance holds for every format, partial panels too."""
    linear = make(50, 64, True)  # panels of 16, 16 | 16, 2: a full pair and a pair ending in two columns
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        batch = linear(x)
        for i in range(7):
            assert torch.equal(linear(x[i : i + 1]), batch[i : i + 1]), f"row {i}"
