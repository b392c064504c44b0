"""Quantized KV caches: ``kv_cache.dtype: int8`` (each key and value row of a token and KV head int8
with its own scale) and ``fp8_e4m3`` (float8 values at a key and a value scale per layer, vLLM's
convention). The oracle is HF generate() with every key and value passed through the same rounding
before attention (a quantized cache has no other reference); either cache holds about a quarter of
float32's bytes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from bm.config import ConfigError, ModelConfig
from bm.runtime import ModelRunner, load_model, work_item
from bm.runtime.attention import LayerExtras
from bm.runtime.backends import ENV_SWITCH
from bm.runtime.kv_quant import (
    FP8,
    SCALE_BYTES,
    checkpoint_kv_scales,
    dequantize_rows,
    quantize_rows,
    round_trip,
)
from bm.runtime.native import paged_decode_kernel, prefill_attention_kernel
from bm.runtime.native.paged_decode import DecodeRows
from tests.conftest import hf_greedy, make_config, random_prompts, reference_model
from tests.native_variants import each_decode_extra, each_decode_shape, each_isa, scattered_tables
from tests.quantized_oracle import assert_each_equals_hf
from tests.test_bf16_oracle import LOGITS_ATOL
from tests.test_oracle import run_staggered

QUANTIZED = ("int8", "fp8_e4m3")
# per-layer fp8 scales, as a calibrated checkpoint carries them: keys and values apart, none a power of 2
FP8_SCALES = {0: (0.0375, 0.021), 1: (0.052, 0.0133)}
_REFERENCE_SCALES: dict[str, dict[int, tuple[float, float]]] = {"fp8_e4m3": FP8_SCALES}


def _quantized_kv_attention(cache_dtype: str):
    """transformers' SDPA attention over keys and values as a ``cache_dtype`` cache gives them back."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        k_scale, v_scale = _REFERENCE_SCALES.get(cache_dtype, {}).get(module.layer_idx, (1.0, 1.0))
        key, value = round_trip(key, cache_dtype, k_scale), round_trip(value, cache_dtype, v_scale)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    return attention


for _dtype in QUANTIZED:
    AttentionInterface.register(f"sdpa_{_dtype}_kv", _quantized_kv_attention(_dtype))


@pytest.fixture(scope="module")
def quantized_models(tiny_model):
    """Per cache dtype: the model bm runs (fp8's carrying FP8_SCALES, as if read from its checkpoint)
    and HF's reference over the same rounding."""
    models = {}
    for cache_dtype in QUANTIZED:
        ref = reference_model(tiny_model)
        ref.set_attn_implementation(f"sdpa_{cache_dtype}_kv")
        scales = _REFERENCE_SCALES.get(cache_dtype, {})
        models[cache_dtype] = (dataclasses.replace(tiny_model, kv_scales=scales), ref)
    return models


def test_a_row_keeps_its_values_within_half_a_step_and_its_scale_in_its_last_four_bytes():
    x = torch.randn(3, 5, 64) * torch.tensor([0.01, 1.0, 300.0]).view(3, 1, 1)
    rows = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (3, 5, 64 + SCALE_BYTES)
    scale = x.abs().amax(-1, keepdim=True) / 127
    assert torch.equal(rows[..., 64:].contiguous().view(torch.float32), scale)
    back = dequantize_rows(rows, torch.float32)
    assert ((back - x).abs() <= scale / 2 * (1 + 1e-6)).all()
    assert rows[..., :64].abs().max() == 127  # each row's largest value takes the full range
    zeros = quantize_rows(torch.zeros(2, 8))
    assert torch.equal(dequantize_rows(zeros, torch.float32), torch.zeros(2, 8))


def test_a_row_is_quantized_from_its_own_values_alone():
    x = torch.randn(6, 32)
    alone = torch.cat([quantize_rows(x[i : i + 1]) for i in range(6)])
    assert torch.equal(quantize_rows(x), alone)  # what else is in the batch never changes a row


def test_an_fp8_row_saturates_at_448_rounds_to_nearest_even_and_keeps_subnormals():
    x = torch.tensor([[500.0, -1000.0, 448.0, 0.0, -0.0, 2.0**-9, 2.0**-10, 1.5 * 2.0**-10, 0.3]])
    rows = quantize_rows(x, "fp8_e4m3")
    assert rows.dtype == FP8 and rows.shape == x.shape  # nothing but the values
    back = dequantize_rows(rows, torch.float32)
    assert back[0, :8].tolist() == [448.0, -448.0, 448.0, 0.0, -0.0, 2.0**-9, 0.0, 2.0**-9]
    assert back[0, 8] == 0.3125  # 0.3's nearest of 0.28125, 0.3125
    scaled = quantize_rows(x, "fp8_e4m3", scale=4.0)  # the layer's scale divides on the way in
    assert torch.equal(dequantize_rows(scaled, torch.float32, 4.0), round_trip(x / 4, "fp8_e4m3") * 4)


@pytest.mark.parametrize(("cache_dtype", "row_extra"), [("int8", SCALE_BYTES), ("fp8_e4m3", 0)])
def test_a_quantized_cache_takes_a_quarter_of_float32s_bytes_plus_any_row_scales(
    tiny_model, cache_dtype, row_extra
):
    heads_dims = list(tiny_model.kv_shapes.values())
    full = tiny_model.kv_cache_bytes_per_token("auto")
    quantized = tiny_model.kv_cache_bytes_per_token(cache_dtype)
    assert full == sum(2 * h * d * 4 for h, d in heads_dims)
    assert quantized == sum(2 * h * (d + row_extra) for h, d in heads_dims)
    runner = ModelRunner(tiny_model, 4, 8, 32, cache_dtype=cache_dtype)
    cache = runner.kv_caches[0]
    h, d = heads_dims[0]
    assert cache.dtype == {"int8": torch.int8, "fp8_e4m3": FP8}[cache_dtype]
    assert cache.shape == (2, h, 4, 8, d + row_extra)
    assert runner.block_bytes == 8 * quantized


@pytest.mark.parametrize(
    ("engine", "kv"),
    [
        ({"max_batch_size": 8, "max_num_tokens": 96}, {"tokens_per_block": 8, "max_tokens": 4096}),
        # chunked prompts, and requests waiting for blocks: keys read back from the cache and the chunk's
        # own alike
        ({"max_batch_size": 16, "max_num_tokens": 32}, {"tokens_per_block": 4, "max_tokens": 160}),
        # block reuse (prefixes read from another request's int8 blocks), overlap scheduling, and a cache
        # so small that max_utilization pauses and resumes requests
        (
            {"max_batch_size": 16, "scheduler_policy": "max_utilization", "overlap_scheduler": "on"},
            {"tokens_per_block": 4, "max_tokens": 96, "enable_block_reuse": True},
        ),
    ],
)
@pytest.mark.parametrize("cache_dtype", QUANTIZED)
def test_greedy_output_with_a_quantized_cache_equals_hf_generate_over_the_same_rounding(
    quantized_models, engine, kv, cache_dtype
):
    model, reference = quantized_models[cache_dtype]
    specs = random_prompts(seed=3, count=16, vocab=model.vocab_size, max_prompt=40, max_output=16)
    config = make_config(engine=engine, kv_cache={**kv, "dtype": cache_dtype})
    client = run_staggered(model, config, specs)
    assert_each_equals_hf(client, specs, reference)


def test_fp8_scales_make_a_difference_the_oracle_can_see(quantized_models, tiny_model):
    """The fp8 oracle above runs at FP8_SCALES: at 1.0 the same requests give other tokens, so bm reads
    the scales it was given (a reference at the wrong scales would have failed it)."""
    model, reference = quantized_models["fp8_e4m3"]
    unit = dataclasses.replace(tiny_model, kv_scales={})
    specs = random_prompts(seed=3, count=16, vocab=model.vocab_size, max_prompt=40, max_output=16)
    config = make_config(kv_cache={"dtype": "fp8_e4m3"})
    at_unit = run_staggered(unit, config, specs)
    differ = [
        i for i, (p, m) in enumerate(specs) if at_unit.results[i].output_ids != hf_greedy(reference, p, m)
    ]
    assert differ, "scales 1.0 and FP8_SCALES gave the same tokens: the oracle cannot tell them apart"


@pytest.mark.parametrize(
    "names",
    [
        ("model.layers.{}.self_attn.k_scale", "model.layers.{}.self_attn.v_scale"),  # llm-compressor
        ("model.layers.{}.self_attn.k_proj.output_scale", "model.layers.{}.self_attn.v_proj.output_scale"),
    ],
)
def test_a_checkpoints_kv_scales_are_read_per_layer_under_vllms_names(tmp_path, tiny_model, names):
    tiny_model.model.save_pretrained(tmp_path)  # a real checkpoint, its scales added as vLLM reads them
    (weights,) = tmp_path.glob("*.safetensors")
    tensors = load_file(weights)
    for layer, (k, v) in FP8_SCALES.items():
        tensors[names[0].format(layer)] = torch.tensor(k)
        tensors[names[1].format(layer)] = torch.tensor([v])  # a one-element tensor as AutoFP8 writes
    save_file(tensors, weights, metadata={"format": "pt"})
    want = {layer: tuple(float(torch.tensor(s)) for s in pair) for layer, pair in FP8_SCALES.items()}
    assert checkpoint_kv_scales(tmp_path) == want
    assert load_model(ModelConfig(path=str(tmp_path), device="cpu")).kv_scales == want


def test_a_checkpoint_without_kv_scales_reads_as_none(tmp_path, tiny_model):
    tiny_model.model.save_pretrained(tmp_path)
    assert checkpoint_kv_scales(tmp_path) == {}


@pytest.mark.parametrize("cache_dtype", QUANTIZED)
def test_a_quantized_cache_is_taken_on_cuda_and_in_bf16_and_an_unknown_dtype_names_the_choices(cache_dtype):
    """CUDA's Triton kernels and every dtype's attention read quantized rows: nothing to refuse there."""
    assert (
        make_config(model={"device": "cuda"}, kv_cache={"dtype": cache_dtype}).kv_cache.dtype == cache_dtype
    )
    assert (
        make_config(model={"dtype": "bfloat16"}, kv_cache={"dtype": cache_dtype}).kv_cache.dtype
        == cache_dtype
    )
    with pytest.raises(ConfigError) as unknown:
        make_config(kv_cache={"dtype": "fp8_e5m2"})
    assert "kv_cache.dtype: unknown value 'fp8_e5m2'; allowed: auto, fp8_e4m3, int8" in str(unknown.value)


def test_int8_rows_are_refused_for_heads_whose_scale_would_sit_unaligned(tiny_model):
    """An int8 row's float32 scale follows its values: heads of 6 would put it at byte 6. fp8 rows
    carry no scale and are taken."""
    odd = dataclasses.replace(
        tiny_model, kv_shapes={layer: (heads, 6) for layer, (heads, _) in tiny_model.kv_shapes.items()}
    )
    with pytest.raises(ValueError, match=r"heads of 6: use kv_cache\.dtype: fp8_e4m3 or auto"):
        ModelRunner(odd, 4, 8, 32, cache_dtype="int8")


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("cache_dtype", QUANTIZED)
def test_a_bf16_models_logits_over_a_quantized_cache_are_within_bf16_tolerance_of_hf_over_the_rounding(
    monkeypatch, cache_dtype, backend
):
    """bf16 has no token-exact oracle (tests/test_bf16_oracle.py); its logits over a quantized cache
    meet the same tolerance against HF's bf16 forward with every key and value rounded as the cache
    rounds them, the prompt in two chunks so the second reads the first's quantized rows back."""
    if backend == "triton":
        pytest.importorskip("triton")
    monkeypatch.setenv(ENV_SWITCH, backend)
    loaded = load_model(ModelConfig(device="cpu", dtype="bfloat16", seed=0))
    loaded = dataclasses.replace(loaded, kv_scales=_REFERENCE_SCALES.get(cache_dtype, {}))
    ref = reference_model(loaded)
    ref.set_attn_implementation(f"sdpa_{cache_dtype}_kv")
    runner = ModelRunner(loaded, 16, 8, 64, cache_dtype=cache_dtype)
    assert runner.attention_backend == backend
    assert runner.kv_caches[0].dtype == {"int8": torch.int8, "fp8_e4m3": FP8}[cache_dtype]
    prompt = random_prompts(seed=7, count=1, vocab=loaded.vocab_size, max_prompt=30, max_output=1)[0][0]
    prompt = (prompt * 3)[:30]
    table = list(range(8))
    first = runner.forward([work_item(prompt[:13], 0, table, True, keep_all=True)])
    second = runner.forward([work_item(prompt[13:], 13, table, True, keep_all=True)])
    with torch.no_grad():
        theirs = ref(torch.tensor([prompt])).logits[0].float()
    assert (torch.cat([first, second]) - theirs).abs().max().item() < LOGITS_ATOL


def test_vllms_fp8_spelling_is_bms_fp8_e4m3():
    assert make_config(kv_cache={"dtype": "fp8"}).kv_cache.dtype == "fp8_e4m3"


# ---- the C decode kernel over a quantized cache ----------------------------------------------------
# It must give exactly what the float32 kernel gives on the dequantized cache (the same float32 product
# per value, then the float32 kernel's operations), in every build this machine runs.

KERNEL_SCALES = (0.37, 2.5)  # an fp8 layer's key and value scales in the kernel tests


def _built(kernel):
    """A kernel of this machine's build, or the test skipped where bm's C kernels do not build."""
    if kernel is None:
        pytest.skip("bm's C kernels do not build here")
    return kernel


def _quantized_paged(cache_dtype, kv_heads, num_blocks, bs, d, lengths, g):
    """A quantized cache of random rows, its dequantized float32 twin, and each row's scattered blocks.
    An fp8 cache takes every byte but NaN's two, subnormals and the largest values included."""
    shape = (2, kv_heads, num_blocks, bs, d)
    if cache_dtype == "int8":
        rows = quantize_rows(torch.randn(*shape, generator=g) * 2)
        return rows, dequantize_rows(rows, torch.float32), scattered_tables(lengths, num_blocks, bs, g)
    codes = torch.randint(0, 254, shape, generator=g, dtype=torch.int32)
    codes = codes + (codes >= 0x7F).int()  # skip 0x7F; 0xFF lies past the range
    rows = codes.to(torch.uint8).view(FP8)
    scales = torch.tensor(KERNEL_SCALES).view(2, 1, 1, 1, 1)
    return rows, dequantize_rows(rows, torch.float32, scales), scattered_tables(lengths, num_blocks, bs, g)


@pytest.mark.parametrize("cache_dtype", QUANTIZED)
@each_decode_shape
@each_isa
def test_quantized_decode_is_the_float32_kernel_on_the_dequantized_cache_bit_for_bit(
    heads, kv_heads, head_dim, block_size, isa, cache_dtype
):
    kernel = _built(paged_decode_kernel(isa))
    g = torch.Generator().manual_seed(heads * 100 + head_dim + block_size)
    lengths = [1, 2, block_size - 1 or 1, block_size + 1, 7 * block_size + 3, 9, 100, 333]
    blocks = sum(-(-n // block_size) for n in lengths) + 3
    cache, widened, table = _quantized_paged(cache_dtype, kv_heads, blocks, block_size, head_dim, lengths, g)
    tokens = 12
    q = torch.randn(tokens, heads, head_dim, generator=g).transpose(0, 1)  # a strided view
    rows = DecodeRows(torch.tensor([3, 0, 11, 7, 8, 2, 1, 5]), table, torch.tensor(lengths), max(lengths))
    want = torch.full((tokens, heads, head_dim), float("nan"))
    kernel(want, q, widened, rows, head_dim**-0.5)
    got = torch.full((tokens, heads, head_dim), float("nan"))
    kernel(got, q, cache, rows, head_dim**-0.5, kv_scales=KERNEL_SCALES)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)  # rows not asked for stay NaN


@pytest.mark.parametrize("cache_dtype", QUANTIZED)
@each_decode_extra
@each_isa
def test_quantized_decode_extras_match_the_float32_kernel_bit_for_bit(
    softcap, alibi, window, sink, isa, cache_dtype
):
    kernel = _built(paged_decode_kernel(isa))
    heads, kv_heads, d, bs = 8, 2, 32, 4
    g = torch.Generator().manual_seed(17)
    lengths = [1, 3, 4, 5, 13, 40, 9, 27]
    cache, widened, table = _quantized_paged(cache_dtype, kv_heads, 48, bs, d, lengths, g)
    q = torch.randn(12, heads, d, generator=g).transpose(0, 1)
    slopes = 2.0 ** (-torch.arange(1, heads + 1, dtype=torch.float32)) if alibi else None
    sinks = torch.randn(heads, generator=g) * 3 if sink else None
    rows = DecodeRows(
        torch.tensor([3, 0, 11, 7, 8, 2, 1, 5]), table, torch.tensor(lengths), max(lengths), window
    )
    extras = LayerExtras(softcap, slopes, sinks)
    want, got = torch.zeros(12, heads, d), torch.zeros(12, heads, d)
    kernel(want, q, widened, rows, 0.2, extras)
    kernel(got, q, cache, rows, 0.2, extras, KERNEL_SCALES)
    assert torch.equal(got, want)


@pytest.mark.parametrize("cache_dtype", QUANTIZED)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 1, 128), (6, 3, 20)])
@pytest.mark.parametrize(("prefix", "length"), [(1, 2), (37, 1), (70, 66)])
@pytest.mark.parametrize("vectorize", [True, False])
@each_isa
def test_quantized_prefill_is_the_float32_kernel_on_the_dequantized_cache_bit_for_bit(
    heads, kv_heads, head_dim, prefix, length, vectorize, isa, cache_dtype
):
    """A chunk after a cached prefix reads a quantized cache in place, dequantizing rows as it packs
    them: the float32 prefill kernel's result on the dequantized cache, with no widened copy."""
    kernel = _built(prefill_attention_kernel(isa))
    g = torch.Generator().manual_seed(prefix * 31 + length + head_dim)
    lengths = [prefix + length]
    cache, widened, table = _quantized_paged(cache_dtype, kv_heads, 40, 8, head_dim, lengths, g)
    table = table[0, : -(-lengths[0] // 8)].contiguous()
    start, tokens = 5, 5 + length + 2
    q = torch.randn(tokens, heads, head_dim, generator=g).transpose(0, 1)
    k = torch.randn(tokens, kv_heads, head_dim, generator=g).transpose(0, 1)  # read from the cache
    want = torch.full((tokens, heads, head_dim), float("nan"))
    kernel(want, q, k, k, start, start + length, 0.3, widened, table, prefix, vectorize=vectorize)
    got = torch.full((tokens, heads, head_dim), float("nan"))
    kernel(got, q, k, k, start, start + length, 0.3, cache, table, prefix, vectorize, KERNEL_SCALES)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_the_simulator_holds_and_reads_a_quantized_cache_at_its_own_bytes():
    from types import SimpleNamespace

    from bm.sim import CostModel, ModelShape, SimExecutor, load_hardware

    shape = ModelShape.from_file(Path(__file__).parents[1] / "configs/models/llama-3.1-8b.json")
    hardware = load_hardware("h100-sxm")
    row = shape.head_dim + SCALE_BYTES
    dtypes = ("auto", *QUANTIZED)
    per_token = {
        d: CostModel(shape, hardware, "bfloat16", kv_cache_dtype=d).kv_bytes_per_token for d in dtypes
    }
    assert per_token == {
        "auto": 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 2,
        "int8": 2 * shape.num_layers * shape.num_kv_heads * row,
        "fp8_e4m3": 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim,  # half of bf16's
    }
    kv = SimpleNamespace(free_memory_fraction=0.9, max_tokens=None, tokens_per_block=32)
    blocks = {
        d: SimExecutor(CostModel(shape, hardware, "bfloat16", kv_cache_dtype=d)).num_kv_blocks(kv, 10**9)
        for d in dtypes
    }
    assert blocks["int8"] / blocks["auto"] == pytest.approx(2 * shape.head_dim / row, rel=1e-3)
    assert blocks["fp8_e4m3"] / blocks["auto"] == pytest.approx(2, rel=1e-3)
