"""Weights quantized on load (``model.quantization: int8``): the format, bm's int8-weight GEMM (the same
bits in every build, each row's bits whatever the batch), and the oracle: greedy output equals HF
generate() on the same model with each quantized weight expanded to ``q * scale`` in float32."""

from __future__ import annotations

import pytest
import torch

import bm
from bm.config import ConfigError
from bm.runtime import load_model
from bm.runtime.model_loader import ModelConfig
from bm.runtime.native import Int8GemmKernel, int8_gemm_kernel
from bm.runtime.weight_quant import dequantized, int8_weight, quantize_weight, quantized_linears
from tests.conftest import hf_greedy, make_config, random_prompts
from tests.native_variants import each_isa
from tests.quantized_oracle import (
    ORACLE_ENGINES,
    assert_greedy_equals_hf,
    assert_lora_matches_peft,
    expanded_reference,
)


@pytest.fixture(scope="module")
def int8_model():
    return load_model(ModelConfig(device="cpu", seed=0, quantization="int8"))


@pytest.fixture(scope="module")
def int8_reference(tiny_model):
    """HF's model with every weight bm quantizes replaced by its expansion ``q * scale``."""
    return expanded_reference(tiny_model, lambda w: dequantized(*quantize_weight(w)))


def _kernel(isa: str | None = None) -> Int8GemmKernel:
    kernel = int8_gemm_kernel(isa)
    if kernel is None:
        pytest.skip("bm's C kernels do not build here")
    return kernel


def test_a_weight_keeps_each_value_within_half_its_rows_step_and_a_zero_row_scale_one():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(9, 40, generator=g) * torch.logspace(-3, 1, 9)[:, None]  # rows of very different size
    w[4] = 0.0
    q, scale = quantize_weight(w)
    assert q.dtype == torch.int8 and scale.shape == (9,) and scale[4] == 1.0
    assert q.abs().amax(1)[[0, 1, 2, 3, 5, 6, 7, 8]].eq(127).all()  # each row's largest value at ±127
    assert ((dequantized(q, scale) - w).abs() <= scale[:, None] / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize(("m", "n", "k"), [(1, 35, 77), (13, 50, 64), (30, 33, 17)])
@each_isa
def test_the_int8_gemm_gives_each_row_the_bits_it_gets_alone_in_every_build(m, n, k, isa):
    """Tiles of twelve rows, shorter tiles and a row alone, a panel pair, a single panel and a part panel:
    every output is one chain over k, so a row's bits never depend on the batch, and every build
    computes the plain C build's very bits."""
    g = torch.Generator().manual_seed(m * n + k)
    kernel, scalar = _kernel(isa), _kernel("scalar")
    x = torch.randn(m, k, generator=g)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale, bias = torch.rand(n, generator=g), torch.randn(n, generator=g)
    packed = kernel.pack(q)
    assert torch.equal(kernel.unpack(packed, n), q)
    y = kernel(x, packed, scale, bias)
    assert torch.equal(y, scalar(x, packed, scale, bias))
    for i in range(m):
        assert torch.equal(kernel(x[i : i + 1], packed, scale, bias), y[i : i + 1]), f"row {i}"
    want = (x.double() @ q.double().T) * scale.double() + bias.double()
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5 * k)


def test_every_decoder_linear_is_int8_and_the_head_and_embeddings_keep_the_model_dtype(int8_model):
    model = int8_model.model
    quantized = quantized_linears(model)
    assert int8_model.num_quantized_linears == len(quantized) > 0
    assert int8_model.quantization == "int8"
    for name, linear in quantized:
        assert linear.weight.dtype == torch.int8, name  # the packed panels: its one copy of the weight
        assert linear.weight.numel() == -(-linear.out_features // 16) * 16 * linear.in_features
        assert linear.weight_scale.shape == (linear.out_features,)
    assert model.get_output_embeddings().weight.dtype == torch.float32
    assert model.get_input_embeddings().weight.dtype == torch.float32


def test_a_quantized_linear_computes_its_expanded_weight_within_rounding(int8_model, tiny_model):
    (_, linear), (_, original) = (
        quantized_linears(int8_model.model)[0],
        quantized_linears(tiny_model.model)[0],
    )
    q, scale = quantize_weight(original.weight)
    assert torch.equal(int8_weight(linear), q) and torch.equal(linear.weight_scale, scale)
    x = torch.randn(5, linear.in_features, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        got = linear(x)
    torch.testing.assert_close(
        got, torch.nn.functional.linear(x, dequantized(q, scale)), rtol=1e-5, atol=1e-5
    )


@ORACLE_ENGINES
def test_greedy_output_with_int8_weights_equals_hf_generate_on_the_expanded_weights(
    int8_model, int8_reference, engine
):
    assert_greedy_equals_hf(int8_model, int8_reference, engine)


def test_int8_weights_change_the_tokens_the_oracle_sees(int8_reference, tiny_model, tiny_reference):
    """The expanded weights are a different model: some of the oracle's requests give other tokens on
    the full-width one, so the test above would catch bm running full-width weights."""
    specs = random_prompts(seed=3, count=16, vocab=tiny_model.vocab_size, max_prompt=40, max_output=16)
    assert any(hf_greedy(int8_reference, p, m) != hf_greedy(tiny_reference, p, m) for p, m in specs)


def test_int8_is_accepted_on_cuda_and_in_the_simulator_and_unknown_schemes_name_the_choices():
    assert (
        make_config(model={"device": "cuda", "quantization": "int8"}).model.quantization == "int8"
    )  # Triton
    sim = make_config(model={"quantization": "int8", "config": "configs/models/bench-llama-15m.json"},
                      engine={"executor": "sim"}, bench={"ignore_eos": True})  # fmt: skip
    assert sim.model.quantization == "int8"  # priced a byte a weight (tests/test_sim.py)
    with pytest.raises(
        ConfigError,
        match=r"model\.quantization: unknown value 'bitsandbytes'; allowed: auto, awq, compressed-tensors, fp8, gguf, gptq, int8, none",
    ):
        make_config(model={"quantization": "bitsandbytes"})


def test_vllms_quantization_keyword_runs_int8_weights_through_llm():
    llm = bm.LLM(quantization="int8", device="cpu", max_model_len=64, max_num_seqs=2)
    assert llm.loaded.quantization == "int8" and llm.loaded.num_quantized_linears > 0
    out = llm.generate([[5, 6, 7]], bm.SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_a_linear_with_a_forward_of_its_own_is_refused_naming_it(tiny_model):
    """A wrapped forward (a tensor-parallel plan's, a LoRA wrapper's) would be silently dropped by the
    int8 forward: the load is refused, naming the layer, before anything is quantized."""
    import copy

    from bm.runtime.prepack import unpack_linears
    from bm.runtime.weight_quant import WeightQuantError, quantize_linears

    model = copy.deepcopy(tiny_model.model)
    unpack_linears(model)  # as loaded: quantization comes before prepacking
    name, linear = quantized_linears(model)[3]
    linear.forward = lambda x: x
    with pytest.raises(WeightQuantError, match=f"{name} .* computes its own forward"):
        quantize_linears(model, "int8")
    assert all(lin.weight.dtype == torch.float32 for _, lin in quantized_linears(model))


def test_a_quantized_model_survives_a_pickle_and_a_deep_copy_computing_the_same_bits(int8_model):
    """Ray and multiprocessing move models by pickle, tests and LLM copies by deepcopy: the int8 forward
    travels as its module and finds its kernel again."""
    import copy
    import pickle

    mlp = int8_model.model.model.layers[0].mlp  # three int8 linears
    x = torch.randn(4, mlp.gate_proj.in_features, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        want = mlp(x)
        for clone in (pickle.loads(pickle.dumps(mlp)), copy.deepcopy(mlp)):
            assert clone.down_proj.weight.dtype == torch.int8
            assert clone.down_proj.forward._module is clone.down_proj  # its own module, not the original's
            assert torch.equal(clone(x), want)


def test_a_checkpoint_saved_quantized_is_refused_naming_its_method_and_the_fix(tmp_path, tiny_reference):
    import json

    from bm.runtime.model_loader import ModelLoadError

    tiny_reference.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ModelLoadError,
        match=r"'bitsandbytes' checkpoint; bm reads GPTQ and AWQ int4 and FP8 .* model\.quantization: int8",
    ):
        load_model(ModelConfig(path=str(tmp_path), device="cpu"))


def test_a_lora_adapter_over_int8_weights_matches_peft_over_the_expanded_weights(
    int8_model, int8_reference, tiny_reference, tmp_path
):
    """bm's LoRA wraps whatever forward a layer has, the int8 one included."""
    assert_lora_matches_peft(int8_model, int8_reference, tiny_reference, tmp_path)
