"""Fused elementwise chains (bm.runtime.fusion): the same numbers as transformers, only inside a bm forward."""

from __future__ import annotations

import copy
import pickle
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, GemmaConfig, LlamaConfig
from transformers.models.llama import modeling_llama

from bm.config import ConfigError, load_config
from bm.runtime.attention import ShapeProbe, forward_context
from bm.runtime.fusion import (
    _FusedDecoderLayer,
    _FusedMLP,
    _FusedRMSNorm,
    _FusedRotary,
    fuse_elementwise,
    should_fuse,
    unfuse_elementwise,
)
from bm.runtime.native import elementwise_kernels
from tests.native_variants import ISAS, each_isa

pytestmark = pytest.mark.skipif(elementwise_kernels() is None, reason="bm's C kernels do not build here")


def in_bm_forward():
    return forward_context(ShapeProbe(), {})


def tiny_llama(**overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    fields = dict(
        vocab_size=64, hidden_size=40, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(LlamaConfig(**{**fields, **overrides})).eval()


@pytest.mark.parametrize("rows", [1, 5, 300])
@pytest.mark.parametrize("cols", [40, 576, 13])
@each_isa
def test_rms_norm_kernel_matches_transformers_rmsnorm_to_rounding(rows, cols, isa):
    kernels = elementwise_kernels(isa)
    norm = modeling_llama.LlamaRMSNorm(cols, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(cols))
        x = torch.randn(rows, cols + 3)[:, :cols]  # a row stride that is not the row length
        got = kernels.rms_norm(x, norm.weight, 1e-5)
        torch.testing.assert_close(got, norm(x), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("rows", [1, 5, 300])
@pytest.mark.parametrize("cols", [40, 576, 13])
@each_isa
def test_add_rms_norm_kernel_gives_the_bits_of_the_add_then_the_norm(rows, cols, isa):
    kernels = elementwise_kernels(isa)
    weight = torch.randn(cols)
    a = torch.randn(rows, cols + 3)[:, :cols]  # row strides that are not the row length
    b = torch.randn(rows, cols + 5)[:, :cols]
    total, normed = kernels.add_rms_norm(a, b, weight, 1e-5)
    expected = a + b
    assert torch.equal(total, expected)
    assert torch.equal(normed, kernels.rms_norm(expected, weight, 1e-5))


@pytest.mark.parametrize("shape", [(1, 72), (7, 13), (300, 1536)])
@each_isa
def test_silu_mul_kernel_matches_torch_to_rounding_across_the_whole_range(shape, isa):
    gate = torch.randn(shape) * 30  # large negative and positive inputs: exp's clamping is exercised
    up = torch.randn(shape)
    got = elementwise_kernels(isa).silu_mul(gate, up)
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tokens,heads,d", [(1, 4, 10), (9, 3, 64), (300, 9, 64), (5, 2, 18)])
@each_isa
def test_rotary_kernel_equals_transformers_rotary_bit_for_bit(tokens, heads, d, isa):
    q = torch.randn(1, tokens, heads * d).view(1, tokens, heads, d).transpose(1, 2)  # as the q projection
    k = torch.randn(1, tokens, d).view(1, tokens, 1, d).transpose(1, 2)
    cos, sin = torch.randn(1, tokens, d), torch.randn(1, tokens, d)
    expected = (
        modeling_llama.apply_rotary_pos_emb.__wrapped__(q, k, cos, sin)
        if isinstance(modeling_llama.apply_rotary_pos_emb, _FusedRotary)
        else modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    )
    kernels = elementwise_kernels(isa)
    got_q = kernels.rotary(q[0].transpose(0, 1), cos[0], sin[0]).transpose(0, 1)[None]
    got_k = kernels.rotary(k[0].transpose(0, 1), cos[0], sin[0]).transpose(0, 1)[None]
    assert torch.equal(got_q, expected[0]) and torch.equal(got_k, expected[1])


def test_a_llama_model_gets_every_norm_mlp_and_its_rotary_fused():
    model = tiny_llama()
    counts = fuse_elementwise(model)
    # two norms per layer and the final one; one MLP per layer; the modeling module's rotary function
    assert counts == {"rms_norm": 5, "mlp": 2, "rotary": 1, "decoder_layer": 2}
    assert isinstance(model.model.norm.forward, _FusedRMSNorm)
    assert isinstance(model.model.layers[1].forward, _FusedDecoderLayer)
    assert isinstance(model.model.layers[0].mlp.forward, _FusedMLP)
    assert isinstance(modeling_llama.apply_rotary_pos_emb, _FusedRotary)


def test_gemma_norms_and_gelu_mlps_are_left_to_transformers():
    torch.manual_seed(0)
    config = GemmaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config).eval()
    counts = fuse_elementwise(model)
    # Gemma's norm scales by 1 + weight and its MLP uses GELU: different code, not fused.
    assert counts["rms_norm"] == 0 and counts["mlp"] == 0


def test_fused_model_forward_matches_transformers_inside_a_bm_forward_and_is_untouched_outside():
    model = tiny_llama()
    ids = torch.randint(0, 64, (1, 11))
    with torch.no_grad():
        expected = model(ids).logits
        fuse_elementwise(model)
        outside = model(ids).logits
        with in_bm_forward():
            # no paged attention in this plain call, only the fused chains: compare the layer pieces
            layer = model.model.layers[0]
            h = torch.randn(1, 11, 40)
            torch.testing.assert_close(layer.input_layernorm(h), layer.input_layernorm.forward._own(h))
            torch.testing.assert_close(layer.mlp(h), layer.mlp.forward._own(h), rtol=1e-5, atol=1e-6)
    assert torch.equal(outside, expected)


def test_fused_decoder_layer_gives_the_bits_of_the_layer_with_only_its_modules_fused():
    """The layer's residual add folded into its post-attention norm changes no bit: compared with the
    layer's own forward, whose norms and MLP are still the fused ones, over prefill and decode sizes."""
    model = tiny_llama()
    fuse_elementwise(model)
    rotary = model.model.rotary_emb
    with torch.no_grad(), in_bm_forward():
        for tokens in (1, 11, 900):
            h = torch.randn(1, tokens, 40) * 3
            positions = torch.arange(tokens)[None]
            emb = rotary(h, positions)
            for layer in model.model.layers:
                assert isinstance(layer.forward, _FusedDecoderLayer)
                got = layer(h, position_ids=positions, position_embeddings=emb)
                want = layer.forward._own(h, position_ids=positions, position_embeddings=emb)
                assert torch.equal(got, want)
                h = got


def test_fused_modules_survive_deepcopy_and_pickle_and_unfuse_restores_the_own_forward():
    model = tiny_llama()
    fuse_elementwise(model)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        norm = clone.model.norm
        assert isinstance(norm.forward, _FusedRMSNorm) and norm.forward._module is norm
        assert clone.model.layers[1].mlp.forward._module is clone.model.layers[1].mlp
    unfuse_elementwise(model)
    assert "forward" not in vars(model.model.norm) and "forward" not in vars(model.model.layers[0].mlp)


def test_unfuse_with_rotary_gives_the_modeling_module_its_own_rotary_back_and_fuse_installs_it_again():
    model = tiny_llama()
    fuse_elementwise(model)
    assert isinstance(modeling_llama.apply_rotary_pos_emb, _FusedRotary)
    unfuse_elementwise(model)  # the default keeps the shared global
    assert isinstance(modeling_llama.apply_rotary_pos_emb, _FusedRotary)
    unfuse_elementwise(model, rotary=True)
    assert not isinstance(modeling_llama.apply_rotary_pos_emb, _FusedRotary)
    assert "forward" not in vars(model.model.norm)
    assert fuse_elementwise(model)["rotary"] == 1
    assert isinstance(modeling_llama.apply_rotary_pos_emb, _FusedRotary)


def test_fused_elementwise_modes():
    cpu = torch.device("cpu")
    assert should_fuse("auto", cpu, torch.float32)
    assert not should_fuse("off", cpu, torch.float32)
    bf16 = torch.bfloat16 in elementwise_kernels().dtypes  # the AVX-512 build's
    assert should_fuse("auto", cpu, torch.bfloat16) == bf16
    assert not should_fuse("auto", cpu, torch.float16)
    with pytest.raises(ValueError, match=r"model\.fused_elementwise is on"):
        should_fuse("on", cpu, torch.float16)


BF16_ISAS = [isa for isa in ISAS if torch.bfloat16 in elementwise_kernels(isa).dtypes]


def test_only_the_avx512_build_offers_bfloat16():
    for isa in ISAS:
        assert (torch.bfloat16 in elementwise_kernels(isa).dtypes) == (isa == "avx512")


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Mostly the same bits; elsewhere one bf16 step apart (the mean's order, exp's last bit in float32
    can move a value across a rounding boundary)."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    step = want.float().abs().clamp(min=1e-30) * 2**-7
    assert ((got.float() - want.float()).abs() <= step).all()
    assert (got == want).float().mean() >= 0.99


@pytest.mark.parametrize("isa", BF16_ISAS)
@pytest.mark.parametrize("cols", [40, 576, 13])
def test_bf16_rms_norm_and_add_rms_norm_kernels_round_as_transformers_bf16_modules(cols, isa):
    kernels = elementwise_kernels(isa)
    norm = modeling_llama.LlamaRMSNorm(cols, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(cols))
        x = torch.randn(300, cols + 3).to(torch.bfloat16)[:, :cols]
        r = torch.randn(300, cols).to(torch.bfloat16)
        assert_bf16_close(kernels.rms_norm(x, norm.weight, 1e-5), norm(x))
        s, y = kernels.add_rms_norm(x, r, norm.weight, 1e-5)
        assert torch.equal(s, x + r)  # one float add, rounded once, as torch's bf16 add
        assert_bf16_close(y, norm(x + r))


@pytest.mark.parametrize("isa", BF16_ISAS)
@pytest.mark.parametrize("cols", [1536, 37])
def test_bf16_silu_mul_kernel_rounds_silu_then_the_product_as_torch_does(cols, isa):
    kernels = elementwise_kernels(isa)
    gate, up = (torch.randn(7, cols).mul(4).to(torch.bfloat16) for _ in range(2))
    with torch.no_grad():
        assert_bf16_close(kernels.silu_mul(gate, up), F.silu(gate) * up)


@pytest.mark.parametrize("isa", BF16_ISAS)
@pytest.mark.parametrize("d", [64, 40])
def test_bf16_rotary_kernel_equals_transformers_rotary_bit_for_bit(d, isa):
    kernels = elementwise_kernels(isa)
    q = torch.randn(1, 6, 9, d).to(torch.bfloat16)
    cos, sin = (torch.randn(1, 9, d).to(torch.bfloat16) for _ in range(2))
    want, _ = modeling_llama.apply_rotary_pos_emb(q, q, cos, sin)
    with torch.no_grad():
        got = kernels.rotary(q[0].transpose(0, 1), cos[0], sin[0]).transpose(0, 1)[None]
    assert torch.equal(got, want)


@pytest.mark.parametrize("isa", BF16_ISAS)
def test_bf16_kernels_round_nan_and_infinities_as_torch(isa):
    kernels = elementwise_kernels(isa)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 3e38, -3e38, 1e-40] * 4)
    x = specials.to(torch.bfloat16).view(1, 1, 32)  # half a head of 16: the sixteen-lane path
    cos = torch.full((1, 32), 1.5).to(torch.bfloat16)
    sin = torch.full((1, 32), 0.5).to(torch.bfloat16)
    want, _ = modeling_llama.apply_rotary_pos_emb(x[None], x[None], cos[None], sin[None])
    got = kernels.rotary(x, cos, sin)
    assert torch.equal(got.isnan(), want[0].transpose(0, 1).isnan())
    ok = ~want[0].transpose(0, 1).isnan()
    assert torch.equal(got[ok], want[0].transpose(0, 1)[ok])


def test_model_fused_elementwise_config_takes_auto_on_off_and_yaml_booleans():
    for value, expected in (("auto", "auto"), ("OFF", "off"), (False, "off"), (True, "on")):
        assert load_config(None, {"model.fused_elementwise": value}).model.fused_elementwise == expected
    with pytest.raises(ConfigError, match=r"model\.fused_elementwise: unknown value 'sometimes'"):
        load_config(None, {"model.fused_elementwise": "sometimes"})


@pytest.mark.filterwarnings("ignore::FutureWarning")  # 5.24 renames the old keyword, with a warning
@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_fused_decoder_layer_runs_fused_when_its_caller_names_an_absent_cache_either_way(name, monkeypatch):
    """transformers 5.24 calls a decoder layer with ``cache=None``; 5.17 (the GPU machines') with
    ``past_key_values=None``. A cache given under that name sent the layer to its own forward, so on the
    GPU the residual add and the norm after attention ran as two kernels, not one: the H100 profile of a
    1B decode step counted two adds per layer. An absent cache under either name keeps the fused path."""
    model = tiny_llama()
    fuse_elementwise(model)
    layer = model.model.layers[0]
    fused = layer.forward
    calls = []
    add_norm = fused._kernels.add_rms_norm
    monkeypatch.setattr(fused, "_kernels", SimpleNamespace(
        accepts=fused._kernels.accepts, add_rms_norm=lambda *a: calls.append(1) or add_norm(*a)
    ))  # fmt: skip
    h = torch.randn(1, 5, 40)
    positions = torch.arange(5)[None]
    emb = model.model.rotary_emb(h, positions)
    with torch.no_grad(), in_bm_forward():
        got = layer(h, position_ids=positions, position_embeddings=emb, **{name: None})
        want = fused._own(h, position_ids=positions, position_embeddings=emb)
    assert calls == [1]
    assert torch.equal(got, want)


def test_the_shared_rotary_global_keeps_the_latest_kernels_of_each_device_type(triton_rotary_on_cpu):
    """transformers' rotary function is one global per modeling module, shared by every model of the
    family in the process. It held the kernels of the first model fused: a CPU model fused before a CUDA
    one left the CUDA one with transformers' rotary. Now each device type keeps its latest kernels."""
    if elementwise_kernels() is None:
        pytest.skip("bm's C kernels do not build here")

    class CudaKernels:  # stands for TritonElementwise("cuda"), which needs no GPU to be handed over
        device_type = "cuda"

        def accepts(self, *tensors):
            return False

    fuse_elementwise(tiny_llama())
    rotary = modeling_llama.apply_rotary_pos_emb
    assert isinstance(rotary, _FusedRotary)
    cpu = rotary._by_device["cpu"]
    cuda = CudaKernels()
    fuse_elementwise(tiny_llama(), cuda)
    assert modeling_llama.apply_rotary_pos_emb is rotary  # one global, now serving both
    assert rotary._by_device == {"cpu": cpu, "cuda": cuda}
