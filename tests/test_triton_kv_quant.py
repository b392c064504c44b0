"""The Triton kernels over a quantized cache (``kv_cache.dtype: int8 | fp8_e4m3``), in Triton's
interpreter: the stores write the very rows bm.runtime.kv_quant writes, the attention kernels (single
pass and split-KV) compute exactly what they compute over the dequantized cache, and the Triton path end
to end gives HF generate()'s tokens over the same rounding, as the CPU path does."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from bm.batch_manager import BatchManager, InferenceRequest
from bm.runtime import ModelRunner
from bm.runtime.backends import ENV_SWITCH
from bm.runtime.kv_quant import FP8, SCALE_BYTES, dequantize_rows, quantize_rows
from bm.runtime.triton.ops import paged_attention, store_kv
from tests.clients import StaggeredClient
from tests.conftest import make_config, random_prompts
from tests.hang import HANG_S
from tests.quantized_oracle import assert_each_equals_hf
from tests.test_kv_quant import QUANTIZED, quantized_models  # noqa: F401 (a fixture)
from tests.test_triton_attention import BS, MIXED, _case
from tests.triton_compile import compile_for_h100

SCALES = (0.37, 2.5)  # an fp8 layer's key and value scales, neither a power of two


def _empty_cache(cache_dtype: str, kv_heads: int, blocks: int, d: int) -> torch.Tensor:
    width = d + SCALE_BYTES if cache_dtype == "int8" else d
    dtype = torch.int8 if cache_dtype == "int8" else FP8
    return torch.zeros(2, kv_heads, blocks, BS, width, dtype=torch.int8).view(dtype)


def _fp8_hard_values(n: int, g: torch.Generator) -> torch.Tensor:
    """Values whose rounding to e4m3 is easy to get wrong, before the scale divides them: ties between
    neighbours (every binade, subnormals too), values past 448, zeros of both signs, and random ones."""
    codes = torch.arange(256, dtype=torch.int32)
    grid = codes[(codes & 0x7F) != 0x7F].to(torch.uint8).view(FP8).float().unique().sort().values
    ties = (grid[:-1] + grid[1:]) / 2
    special = torch.tensor([448.0, 464.0, 500.0, -1e4, 0.0, -0.0, 2.0**-10, -(2.0**-10), 3 * 2.0**-11])
    values = torch.cat([grid, ties, special, torch.randn(n, generator=g) * 100])
    return values[torch.randperm(values.numel(), generator=g)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("cache_dtype", "scales"), [("int8", SCALES), ("fp8_e4m3", (1.0, 1.0)), ("fp8_e4m3", SCALES)]
)
def test_the_triton_store_writes_the_rows_kv_quant_writes_byte_for_byte(cache_dtype, scales, dtype):
    """Keys and values of 7 tokens (one a padding row) stored through the slot mapping: each row's bytes
    are quantize_rows' (an int8 row's values and scale, an fp8 row's codes at the layer's scale; at
    scale 1 the ties between e4m3 neighbours meet the rounding as they are), and nothing else in the
    cache is touched."""
    g = torch.Generator().manual_seed(7)
    kv_heads, tokens, d = 2, 7, 48
    n = 2 * kv_heads * tokens * d
    if cache_dtype == "fp8_e4m3":
        values = _fp8_hard_values(n, g)[:n].view(2, kv_heads, tokens, d)
        values = values * torch.tensor(scales).view(2, 1, 1, 1)
    else:
        values = torch.randn(2, kv_heads, tokens, d, generator=g) * 3
        values[0, 1, 2] = 0.0  # an all-zero row: scale 1
    values = values.to(dtype)
    key, value = values[0], values[1]
    slots = torch.tensor([5, 0, -1, 17, 9, 3, 22], dtype=torch.int32)
    cache = _empty_cache(cache_dtype, kv_heads, 6, d)
    store_kv(cache, key, value, slots, scales)
    stored = cache.view(torch.int8).view(2, kv_heads, -1, cache.shape[-1])
    for t, slot in enumerate(slots.tolist()):
        for which, x in enumerate((key, value)):
            if slot >= 0:
                want = quantize_rows(x[:, t], cache_dtype, scales[which]).view(torch.int8)
                assert torch.equal(stored[which, :, slot], want), (t, which)
    written = torch.zeros(stored.shape[2], dtype=torch.bool)
    written[[s for s in slots.tolist() if s >= 0]] = True
    assert not stored[:, :, ~written].any()


def _quantized_case(cache_dtype, dtype, specs, heads, kv_heads, head_dim, seed=0):
    """A mixed batch (tests.test_triton_attention's) over a quantized cache of random rows, and the
    cache's dequantized twin in the model's dtype."""
    cache, q, _k, _v, inputs, _tables = _case(specs, heads, kv_heads, head_dim, torch.float32, seed)
    scales = SCALES if cache_dtype == "fp8_e4m3" else (1.0, 1.0)
    pair = torch.tensor(scales).view(2, 1, 1, 1, 1)
    rows = torch.cat([quantize_rows(cache[i : i + 1] * 2, cache_dtype, scales[i]) for i in (0, 1)])
    return rows, dequantize_rows(rows, dtype, pair), q.to(dtype), inputs.batch, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", QUANTIZED)
def test_attention_over_a_quantized_cache_is_the_kernel_over_the_dequantized_cache_bit_for_bit(
    cache_dtype, dtype
):
    """Decode rows, whole prompts and chunks after a cached prefix in one launch, grouped query heads:
    widening each tile in registers gives the very bits of reading the widened cache. In bfloat16 the
    interpreter's cast from float32 rounds otherwise than torch's (and the GPU's), so there the check
    allows bf16 rounding (tests/test_triton_elementwise.py pins that difference)."""
    rows, twin, q, batch, scales = _quantized_case(cache_dtype, dtype, MIXED, 6, 2, 64)
    got, want = (torch.empty(q.shape[1], 6, 64, dtype=dtype) for _ in range(2))
    paged_attention(got, q, rows, batch, 0.125, block_n=16, kv_scales=scales)
    paged_attention(want, q, twin, batch, 0.125, block_n=16)
    if dtype == torch.float32:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("cache_dtype", QUANTIZED)
def test_split_kv_decode_over_a_quantized_cache_is_the_kernel_over_the_dequantized_cache(cache_dtype):
    """The split-KV pair (three splits of 16-key tiles) over decode rows of several lengths, with an
    attention window and sink tokens: the same bits as over the widened cache."""
    specs = [(37, 1), (5, 1), (60, 1), (22, 1)]
    rows, twin, q, batch, scales = _quantized_case(cache_dtype, torch.float32, specs, 4, 2, 32, seed=3)
    batch = batch.with_window(24, 2)
    got, want = (torch.empty(4, 4, 32) for _ in range(2))
    paged_attention(got, q, rows, batch, 0.2, block_n=16, num_splits=3, kv_scales=scales)
    paged_attention(want, q, twin, batch, 0.2, block_n=16, num_splits=3)
    assert torch.equal(got, want)


@pytest.mark.parametrize("cache_dtype", QUANTIZED)
def test_the_fused_rotary_store_quantizes_as_the_store_kernel_does(cache_dtype):
    """The GPU path's rotary-and-store launch writes a quantized cache's rows with the bits of rotating
    (rotary_pair) and then storing (store_kv): one row format, two kernels that write it."""
    from bm.runtime.triton.elementwise import TritonElementwise

    kernels = TritonElementwise("cpu")
    torch.manual_seed(5)
    tokens, d = 5, 32
    qkv = torch.randn(tokens, 10 * d)
    q, k = qkv[:, : 6 * d].view(tokens, 6, d), qkv[:, 6 * d : 8 * d].view(tokens, 2, d)
    v = qkv[:, 8 * d :].view(tokens, 2, d)
    cos, sin = torch.randn(tokens, d), torch.randn(tokens, d)
    slots = torch.tensor([13, 2, -1, 30, 7], dtype=torch.int32)  # blocks of BS tokens, a padding row
    with torch.inference_mode():
        cache = _empty_cache(cache_dtype, 2, 8, d)
        got_q = kernels.rotary_store_kv(q, k, v, cos, sin, cache, slots, SCALES)
        want_q, want_k = kernels.rotary_pair(q, k, cos, sin)
        want = _empty_cache(cache_dtype, 2, 8, d)
        store_kv(want, want_k.transpose(0, 1), v.transpose(0, 1), slots, SCALES)
    assert torch.equal(got_q, want_q)
    assert torch.equal(cache.view(torch.int8), want.view(torch.int8))
    assert cache.view(torch.int8).any()


@pytest.mark.parametrize("cache_dtype", QUANTIZED)
def test_greedy_output_on_the_triton_path_with_a_quantized_cache_equals_hf_generate_over_the_rounding(
    quantized_models,  # noqa: F811 (the fixture imported above)
    monkeypatch,
    cache_dtype,
):
    """The engine on the Triton path (interpreted) with chunked prompts and prefixes reused from another
    request's quantized blocks: HF generate()'s tokens with every key and value rounded as the cache
    rounds them (fp8 at per-layer scales, as read from a checkpoint), as on the CPU path."""
    monkeypatch.setenv(ENV_SWITCH, "triton")
    model, reference = quantized_models[cache_dtype]
    shared = random_prompts(seed=5, count=1, vocab=model.vocab_size, max_prompt=20, max_output=1)[0][0]
    specs = random_prompts(seed=3, count=8, vocab=model.vocab_size, max_prompt=24, max_output=8)
    specs = [((shared + p) if i % 2 else p, m) for i, (p, m) in enumerate(specs)]
    config = make_config(
        engine={"max_batch_size": 6, "max_num_tokens": 24, "enable_chunked_context": True},
        kv_cache={
            "tokens_per_block": 4,
            "max_tokens": 1024,
            "enable_block_reuse": True,
            "dtype": cache_dtype,
        },
    )
    requests = [InferenceRequest.from_values(i, p, m) for i, (p, m) in enumerate(specs)]
    client = StaggeredClient(requests, per_iteration=3)
    assert ModelRunner(model, 8, 4, 32, cache_dtype=cache_dtype).attention_backend == "triton"
    with BatchManager(config, client.get_requests, client.send_response, model=model):
        client.wait_or_fail(timeout=HANG_S)  # Triton's interpreter is slow, more so on a busy machine
    assert_each_equals_hf(client, specs, reference)


# The store and single-pass attention kernels over each quantized cache, compiled for an H100
# (tests/triton_compile.py): the interpreter above forgives what the compiler refuses (the pointer casts
# to an int8 row's scale and to an fp8 row's bytes among them).
_BUILDS = """
for q, dot in (("bf16", kernels.DOT_FAST), ("fp32", kernels.DOT_IEEE)):
    for cache, quant in (("i8", 1), ("fp8e4nv", 2)):  # int8 rows, fp8
        strides = dict.fromkeys(["c_stride_h", "c_stride_b", "c_stride_t"], "i32")
        build(kernels.store_kv_kernel,
              {"key_ptr": f"*{q}", "value_ptr": f"*{q}", "k_cache_ptr": f"*{cache}", "v_cache_ptr": f"*{cache}",
               "slot_mapping_ptr": "*i32", **dict.fromkeys(["k_stride_h", "k_stride_t", "v_stride_h",
               "v_stride_t"], "i32"), **strides, "k_scale": "fp32", "v_scale": "fp32"},
              {"TOKENS_PER_BLOCK": 16, "HEAD_DIM": 64, "HEAD_PAD": 64, "KV_QUANT": quant})
        ints = ["window", "sink_tokens", "num_seqs", "bt_stride", "q_stride_h", "q_stride_t", "o_stride_t",
                "o_stride_h"]
        build(kernels.paged_attention_kernel,
              {"out_ptr": f"*{q}", "q_ptr": f"*{q}", "k_cache_ptr": f"*{cache}", "v_cache_ptr": f"*{cache}",
               "block_table_ptr": "*i32", "seq_lens_ptr": "*i32", "cu_q_ptr": "*i32", "sinks_ptr": "*fp32",
               "alibi_ptr": "*fp32", "scale": "fp32", "softcap": "fp32", "k_scale": "fp32", "v_scale": "fp32",
               **dict.fromkeys(ints, "i32"), **strides},
              {"GROUP": 3, "BLOCK_Q": 5, "BLOCK_M": 16, "BLOCK_N": 64, "HEAD_DIM": 64, "HEAD_PAD": 64,
               "TOKENS_PER_BLOCK": 16, "USE_SOFTCAP": False, "USE_ALIBI": False, "USE_SINKS": False,
               "USE_WINDOW": True, "DOT": dot, "KV_QUANT": quant})
"""


def test_the_quantized_cache_kernels_compile_for_an_h100_without_one(tmp_path):
    built = compile_for_h100("kernels.py", _BUILDS, tmp_path)
    assert built == ["store_kv_kernel", "paged_attention_kernel"] * 4  # int8, fp8; bf16 and fp32 queries
