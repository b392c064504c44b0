"""FP8 on load (``model.quantization: fp8`` on a full-width model, vLLM's ``quantization="fp8"``): each
decoder linear becomes e4m3 codes with a float32 scale per output row, run by the group GEMM, and the
oracle holds on the weights expanded to ``e4m3 * scale``. An FP8 checkpoint still reads as stored
(tests/test_fp8_checkpoints.py)."""

from __future__ import annotations

import pytest
import torch

import bm
from bm.runtime import load_model
from bm.runtime.group_linears import E4M3_MAX, GroupForward, fp8_rows, group_weight
from bm.runtime.model_loader import ModelConfig, ModelLoadError
from bm.runtime.weight_quant import quantized_linears
from tests.conftest import hf_greedy, random_prompts
from tests.quantized_oracle import (
    ORACLE_ENGINES,
    assert_greedy_equals_hf,
    assert_lora_matches_peft,
    expanded_reference,
)


@pytest.fixture(scope="module")
def fp8(tiny_model):
    """bm's tiny model with FP8 on load, and HF's copy with each such weight expanded to e4m3 * scale."""
    loaded = load_model(ModelConfig(device="cpu", seed=0, quantization="fp8"))
    return loaded, expanded_reference(tiny_model, lambda w: fp8_rows(w).expanded())


def test_each_weight_is_its_rows_scale_times_the_nearest_e4m3_and_a_zero_row_scales_by_one():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 64, generator=g) * torch.tensor([1e-3, 0.02, 1.0, 30.0, 0.0])[:, None]
    packed = fp8_rows(w)
    scale = torch.where(w.abs().amax(1) == 0, torch.ones(5), w.abs().amax(1) / E4M3_MAX)
    expected = (w / scale[:, None]).to(torch.float8_e4m3fn).float() * scale[:, None]
    assert torch.equal(packed.expanded(), expected)
    assert packed.expanded()[4].abs().sum() == 0
    # each row's largest weight is e4m3's largest finite value times its scale: the range is used
    assert torch.equal(packed.expanded()[:4].abs().amax(1), E4M3_MAX * scale[:4])


def test_every_decoder_linear_is_fp8_rows_and_the_head_keeps_the_model_dtype(fp8):
    fp8_model = fp8[0]
    assert fp8_model.quantization == "fp8" and fp8_model.num_quantized_linears > 0
    model = fp8_model.model
    for name, linear in quantized_linears(model):
        assert isinstance(linear.__dict__["forward"], GroupForward), name
        held = group_weight(linear)
        assert (held.bits, held.group, held.float8) == (8, linear.in_features, True), name
        assert linear.weight.dtype == torch.uint8
    assert model.get_output_embeddings().weight.dtype == fp8_model.dtype


@ORACLE_ENGINES
def test_greedy_output_with_fp8_weights_equals_hf_generate_on_the_expanded_weights(fp8, engine):
    assert_greedy_equals_hf(*fp8, engine)


def test_fp8_weights_change_the_tokens_the_oracle_sees(fp8, tiny_model, tiny_reference):
    """The expanded weights are a different model, so the oracle above would catch full-width weights."""
    fp8_reference = fp8[1]
    specs = random_prompts(seed=3, count=16, vocab=tiny_model.vocab_size, max_prompt=40, max_output=16)
    assert any(hf_greedy(fp8_reference, p, m) != hf_greedy(tiny_reference, p, m) for p, m in specs)


def test_a_lora_adapter_over_fp8_weights_matches_peft_over_the_expanded_weights(
    fp8, tiny_reference, tmp_path
):
    assert_lora_matches_peft(*fp8, tiny_reference, tmp_path)


def test_vllms_fp8_keyword_quantizes_a_full_width_checkpoint_on_load(tmp_path, tiny_reference):
    tiny_reference.save_pretrained(tmp_path / "ckpt")
    llm = bm.LLM(str(tmp_path / "ckpt"), quantization="fp8", device="cpu", max_model_len=64, max_num_seqs=2)
    assert llm.loaded.quantization == "fp8" and llm.loaded.num_quantized_linears > 0
    out = llm.generate([[5, 6, 7]], bm.SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_the_schemes_that_only_read_checkpoints_name_both_on_load_schemes():
    with pytest.raises(ModelLoadError, match=r"gptq checkpoints; this model is not one: .*int8 or fp8"):
        load_model(ModelConfig(device="cpu", seed=0, quantization="gptq"))
