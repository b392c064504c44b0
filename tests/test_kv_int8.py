"""``kv_cache.dtype: int8``: each key and value row of a token and KV head stored as int8 with its own
scale. The oracle is HF generate() with every key and value passed through the same rounding before
attention (an int8 cache has no other reference); the cache holds about a quarter of float32's bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from bm.config import ConfigError
from bm.runtime import ModelRunner
from bm.runtime.attention import LayerExtras
from bm.runtime.kv_quant import SCALE_BYTES, dequantize_rows, quantize_rows, round_trip
from bm.runtime.native import paged_decode_kernel
from bm.runtime.native.paged_decode import DecodeRows
from bm.scheduling import FinishReason
from tests.conftest import hf_greedy, make_config, random_prompts, reference_model
from tests.native_variants import each_decode_extra, each_decode_shape, each_isa, scattered_tables
from tests.test_oracle import run_staggered


def _int8_kv_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention over keys and values as an int8 cache gives them back."""
    return sdpa_attention_forward(module, query, round_trip(key), round_trip(value), attention_mask, **kwargs)


AttentionInterface.register("sdpa_int8_kv", _int8_kv_attention)


@pytest.fixture(scope="module")
def int8_reference(tiny_model):
    ref = reference_model(tiny_model)
    ref.set_attn_implementation("sdpa_int8_kv")
    return ref


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


def test_the_int8_cache_takes_a_quarter_of_float32s_bytes_plus_the_scales(tiny_model):
    heads_dims = list(tiny_model.kv_shapes.values())
    full = tiny_model.kv_cache_bytes_per_token("auto")
    int8 = tiny_model.kv_cache_bytes_per_token("int8")
    assert full == sum(2 * h * d * 4 for h, d in heads_dims)
    assert int8 == sum(2 * h * (d + SCALE_BYTES) for h, d in heads_dims)
    runner = ModelRunner(tiny_model, 4, 8, 32, cache_dtype="int8")
    cache = runner.kv_caches[0]
    h, d = heads_dims[0]
    assert cache.dtype == torch.int8 and cache.shape == (2, h, 4, 8, d + SCALE_BYTES)
    assert runner.block_bytes == 8 * int8


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
def test_greedy_output_with_an_int8_cache_equals_hf_generate_over_the_same_rounding(
    tiny_model, int8_reference, engine, kv
):
    specs = random_prompts(seed=3, count=16, vocab=tiny_model.vocab_size, max_prompt=40, max_output=16)
    config = make_config(engine=engine, kv_cache={**kv, "dtype": "int8"})
    client = run_staggered(tiny_model, config, specs)
    for i, (prompt, max_new) in enumerate(specs):
        result = client.results[i]
        assert result.ok, result.error
        assert result.finish_reason == FinishReason.LENGTH
        assert result.output_ids == hf_greedy(int8_reference, prompt, max_new), f"request {i}"


def test_int8_cache_is_refused_on_cuda_and_an_unknown_dtype_names_the_choices():
    with pytest.raises(ConfigError) as cuda:
        make_config(model={"device": "cuda"}, kv_cache={"dtype": "int8"})
    assert "kv_cache.dtype: int8 is read by the CPU's attention paths only so far" in str(cuda.value)
    with pytest.raises(ConfigError) as unknown:
        make_config(kv_cache={"dtype": "fp4"})
    assert "kv_cache.dtype: unknown value 'fp4'; allowed: auto, int8" in str(unknown.value)
    with pytest.raises(ConfigError) as bf16:
        make_config(model={"dtype": "bfloat16"}, kv_cache={"dtype": "int8"})
    assert "model.dtype is bfloat16; give model.dtype: float32" in str(bf16.value)


# ---- the C decode kernel over an int8 cache --------------------------------------------------------
# It must give exactly what the float32 kernel gives on the dequantized cache (the same float32 product
# per value, then the float32 kernel's operations), in every build this machine runs.


def _int8_paged(kv_heads, num_blocks, bs, d, lengths, g):
    """An int8 cache of random rows, its dequantized float32 twin, and each row's scattered blocks."""
    rows = quantize_rows(torch.randn(2, kv_heads, num_blocks, bs, d, generator=g) * 2)
    return rows, dequantize_rows(rows, torch.float32), scattered_tables(lengths, num_blocks, bs, g)


@each_decode_shape
@each_isa
def test_int8_decode_is_the_float32_kernel_on_the_dequantized_cache_bit_for_bit(
    heads, kv_heads, head_dim, block_size, isa
):
    kernel = paged_decode_kernel(isa)
    if kernel is None:
        pytest.skip("bm's C kernels do not build here")
    g = torch.Generator().manual_seed(heads * 100 + head_dim + block_size)
    lengths = [1, 2, block_size - 1 or 1, block_size + 1, 7 * block_size + 3, 9, 100, 333]
    blocks = sum(-(-n // block_size) for n in lengths) + 3
    cache, widened, table = _int8_paged(kv_heads, blocks, block_size, head_dim, lengths, g)
    tokens = 12
    q = torch.randn(tokens, heads, head_dim, generator=g).transpose(0, 1)  # a strided view
    rows = DecodeRows(torch.tensor([3, 0, 11, 7, 8, 2, 1, 5]), table, torch.tensor(lengths), max(lengths))
    want = torch.full((tokens, heads, head_dim), float("nan"))
    kernel(want, q, widened, rows, head_dim**-0.5)
    got = torch.full((tokens, heads, head_dim), float("nan"))
    kernel(got, q, cache, rows, head_dim**-0.5)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)  # rows not asked for stay NaN


@each_decode_extra
@each_isa
def test_int8_decode_extras_match_the_float32_kernel_bit_for_bit(softcap, alibi, window, sink, isa):
    kernel = paged_decode_kernel(isa)
    if kernel is None:
        pytest.skip("bm's C kernels do not build here")
    heads, kv_heads, d, bs = 8, 2, 32, 4
    g = torch.Generator().manual_seed(17)
    lengths = [1, 3, 4, 5, 13, 40, 9, 27]
    cache, widened, table = _int8_paged(kv_heads, 48, bs, d, lengths, g)
    q = torch.randn(12, heads, d, generator=g).transpose(0, 1)
    slopes = 2.0 ** (-torch.arange(1, heads + 1, dtype=torch.float32)) if alibi else None
    sinks = torch.randn(heads, generator=g) * 3 if sink else None
    rows = DecodeRows(
        torch.tensor([3, 0, 11, 7, 8, 2, 1, 5]), table, torch.tensor(lengths), max(lengths), window
    )
    extras = LayerExtras(softcap, slopes, sinks)
    want, got = torch.zeros(12, heads, d), torch.zeros(12, heads, d)
    kernel(want, q, widened, rows, 0.2, extras)
    kernel(got, q, cache, rows, 0.2, extras)
    assert torch.equal(got, want)


def test_the_simulator_holds_and_reads_an_int8_cache_at_its_own_bytes():
    from types import SimpleNamespace

    from bm.sim import CostModel, ModelShape, SimExecutor, load_hardware

    shape = ModelShape.from_file(Path(__file__).parents[1] / "configs/models/llama-3.1-8b.json")
    hardware = load_hardware("h100-sxm")
    row = shape.head_dim + SCALE_BYTES
    per_token = {
        d: CostModel(shape, hardware, "bfloat16", kv_cache_dtype=d).kv_bytes_per_token
        for d in ("auto", "int8")
    }
    assert per_token == {
        "auto": 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 2,
        "int8": 2 * shape.num_layers * shape.num_kv_heads * row,
    }
    kv = SimpleNamespace(free_memory_fraction=0.9, max_tokens=None, tokens_per_block=32)
    blocks = {
        d: SimExecutor(CostModel(shape, hardware, "bfloat16", kv_cache_dtype=d)).num_kv_blocks(kv, 10**9)
        for d in ("auto", "int8")
    }
    assert blocks["int8"] / blocks["auto"] == pytest.approx(2 * shape.head_dim / row, rel=1e-3)
