"""The compiled prefill attention kernel: the same causal attention as torch's SDPA, whole prompts and
chunks after a cached prefix, and the same engine output as HF generate() when bm runs it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from bm.batch_manager import BatchManager, InferenceRequest
from bm.runtime.backends import torch_ops
from bm.runtime.backends.torch_layout import PrefillSegment
from bm.runtime.native import ENV_SWITCH, prefill_attention_kernel
from tests.clients import StaggeredClient
from tests.conftest import hf_greedy, make_config, random_prompts
from tests.native_variants import each_isa

kernel = prefill_attention_kernel()
needs_kernel = pytest.mark.skipif(kernel is None, reason="no C compiler here: bm runs SDPA")

# (heads, kv_heads, head_dim): GQA groups 3, 1, 4; head sizes 64, 128, 80 (five 16-column panels),
# 72 (an 8-column tail) and 20 (not a multiple of 8: the plain C loops even where AVX2 is present)
SHAPES = [(9, 3, 64), (4, 4, 64), (8, 2, 128), (6, 2, 80), (8, 4, 72), (6, 3, 20)]
# around the 16-token query tiles, the 16-key panels and the 64-key blocks
LENGTHS = [1, 2, 15, 16, 17, 63, 64, 65, 130]


def packed_views(tokens: int, heads: int, kv_heads: int, d: int, g: torch.Generator):
    """q [heads, T, d], k/v [kv_heads, T, d] as transposed views of [T, heads, d], as transformers gives
    them to the attention function."""
    q = torch.randn(tokens, heads, d, generator=g).transpose(0, 1)
    k = torch.randn(tokens, kv_heads, d, generator=g).transpose(0, 1)
    v = torch.randn(tokens, kv_heads, d, generator=g).transpose(0, 1)
    return q, k, v


@needs_kernel
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), SHAPES)
@pytest.mark.parametrize("vectorize", [True, False])
@each_isa
def test_prefill_kernel_matches_causal_sdpa_on_whole_prompts(heads, kv_heads, head_dim, vectorize, isa):
    kernel = prefill_attention_kernel(isa)
    g = torch.Generator().manual_seed(heads * 1000 + head_dim)
    scale = head_dim**-0.5
    for length in LENGTHS:
        start = 3  # the chunk sits inside a packed batch of other tokens
        tokens = start + length + 4
        q, k, v = packed_views(tokens, heads, kv_heads, head_dim, g)
        out = torch.full((tokens, heads, head_dim), float("nan"))
        kernel(out, q, k, v, start, start + length, scale, vectorize=vectorize)
        sl = slice(start, start + length)
        want = F.scaled_dot_product_attention(
            q[None, :, sl], k[None, :, sl], v[None, :, sl], is_causal=True, scale=scale, enable_gqa=True
        )[0].transpose(0, 1)
        torch.testing.assert_close(out[sl], want, rtol=1e-5, atol=2e-5, msg=f"length {length}")
        assert torch.isnan(out[:start]).all() and torch.isnan(out[start + length :]).all()


@needs_kernel
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 1, 128), (6, 3, 20)])
@pytest.mark.parametrize(("prefix", "length"), [(1, 2), (15, 17), (16, 16), (37, 1), (70, 66), (200, 9)])
@pytest.mark.parametrize("vectorize", [True, False])
@each_isa
def test_prefill_kernel_reads_a_cached_prefix_through_the_block_table(
    heads, kv_heads, head_dim, prefix, length, vectorize, isa
):
    """Keys and values come from scattered cache blocks, the chunk's own already written there; blocks
    and slots past the context hold NaN, so reading any of them would show in the output."""
    g = torch.Generator().manual_seed(prefix * 31 + length)
    bs, num_blocks = 8, 64
    ctx = prefix + length
    used = -(-ctx // bs)
    table = torch.randperm(num_blocks, generator=g)[:used]
    cache = torch.full((2, kv_heads, num_blocks, bs, head_dim), float("nan"))
    keys = torch.randn(2, kv_heads, ctx, head_dim, generator=g)
    slots = table[torch.arange(ctx) // bs] * bs + torch.arange(ctx) % bs
    cache.view(2, kv_heads, num_blocks * bs, head_dim)[:, :, slots] = keys
    start, tokens = 5, 5 + length + 2
    q, k, v = packed_views(tokens, heads, kv_heads, head_dim, g)
    k[:, start : start + length] = keys[0, :, prefix:]  # what the attention call writes to the cache
    v[:, start : start + length] = keys[1, :, prefix:]
    out = torch.full((tokens, heads, head_dim), float("nan"))
    scale = 0.3
    kernel = prefill_attention_kernel(isa)
    kernel(out, q, k, v, start, start + length, scale, cache, table, prefix, vectorize=vectorize)
    mask = torch.arange(ctx)[None, :] <= torch.arange(prefix, ctx)[:, None]
    want = F.scaled_dot_product_attention(
        q[None, :, start : start + length], keys[0][None], keys[1][None], attn_mask=mask, scale=scale,
        enable_gqa=True,
    )[0].transpose(0, 1)  # fmt: skip
    torch.testing.assert_close(out[start : start + length], want, rtol=1e-5, atol=2e-5)
    assert torch.isnan(out[:start]).all() and torch.isnan(out[start + length :]).all()


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3, 7])
@each_isa
def test_prefill_kernel_result_does_not_depend_on_the_thread_count(threads, isa):
    """Each (kv head, query tile) item is computed whole by one thread, in one order."""
    kernel = prefill_attention_kernel(isa)
    g = torch.Generator().manual_seed(5)
    q, k, v = packed_views(200, 9, 3, 64, g)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.empty(200, 9, 64)
        kernel(one, q, k, v, 0, 200, 0.125)
        torch.set_num_threads(threads)
        many = torch.empty(200, 9, 64)
        kernel(many, q, k, v, 0, 200, 0.125)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(one, many)


@needs_kernel
def test_prefill_kernel_refuses_shapes_it_would_read_out_of_bounds():
    q, k, v = packed_views(10, 6, 2, 32, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="disagree"):
        kernel(torch.empty(10, 6, 16), q, k, v, 0, 10, 1.0)  # out's head size
    with pytest.raises(ValueError, match="disagree"):
        kernel(torch.empty(10, 6, 32), q, k, v, 4, 12, 1.0)  # past the batch
    with pytest.raises(ValueError, match="block table"):
        kernel(torch.empty(10, 6, 32), q, k, v, 0, 10, 1.0, prefix_len=3)
    cache = torch.zeros(2, 2, 4, 4, 32)
    with pytest.raises(ValueError, match="covering all 13 keys"):
        kernel(torch.empty(10, 6, 32), q, k, v, 0, 10, 1.0, cache, torch.tensor([0, 1, 2]), 3)


def test_window_masks_and_odd_head_sizes_stay_with_sdpa():
    """The kernel does plain causal attention only: an attention window's mask goes to SDPA, and so does
    a head size its vector path cannot take (its plain C loops are slower than SDPA)."""
    q = torch.zeros(4, 10, 64)
    cache = torch.zeros(2, 2, 4, 4, 64)
    windowed = PrefillSegment(0, 10, 0, None, torch.ones(10, 10, dtype=torch.bool))
    assert torch_ops._native_prefill(q, cache, windowed) is None
    gathered = PrefillSegment(
        0, 10, 6, torch.tensor([0, 1, 2, 3]), torch.ones(10, 16, dtype=torch.bool), torch.arange(16)
    )
    assert torch_ops._native_prefill(q, cache, gathered) is None  # key positions: a windowed gather
    plain = PrefillSegment(0, 10, 0)
    assert torch_ops._native_prefill(torch.zeros(4, 10, 20), cache, plain) is None
    assert torch_ops._native_prefill(q.double(), cache, plain) is None
    if kernel is not None:
        assert torch_ops._native_prefill(q, cache, plain) is kernel


def test_the_scalar_build_still_serves_prefill_for_batch_invariance(monkeypatch):
    """SDPA's sums depend on how a prompt is chunked; the plain C loops' do not."""
    from bm.cpu_isa import ENV_ISA, machine_isas

    if "scalar" not in machine_isas() or prefill_attention_kernel("scalar") is None:
        pytest.skip("needs an x86-64 CPU and a C compiler")
    monkeypatch.setenv(ENV_ISA, "scalar")
    plain = PrefillSegment(0, 10, 0)
    chosen = torch_ops._native_prefill(torch.zeros(4, 10, 64), torch.zeros(2, 2, 4, 4, 64), plain)
    assert chosen is not None and chosen.isa == "scalar" and not chosen.vectorized


def test_native_kernels_switched_off_leave_prefill_on_sdpa(monkeypatch):
    monkeypatch.setenv(ENV_SWITCH, "0")
    plain = PrefillSegment(0, 10, 0)
    assert torch_ops._native_prefill(torch.zeros(4, 10, 64), torch.zeros(2, 2, 4, 4, 64), plain) is None


@needs_kernel
@pytest.mark.parametrize("chunked", [False, True])
def test_greedy_output_equals_hf_generate_with_the_prefill_kernel(
    tiny_model, tiny_reference, monkeypatch, chunked
):
    """Whole prompts, and with chunked context the later chunks read their prefix from the cache."""
    calls = {"whole": 0, "after_prefix": 0}

    def counting(*args, **kwargs):
        calls["after_prefix" if args[9] else "whole"] += 1
        return kernel(*args, **kwargs)

    counting.vectorized, counting.dtypes = kernel.vectorized, kernel.dtypes
    monkeypatch.setattr(torch_ops, "prefill_attention_kernel", lambda: counting)
    specs = random_prompts(seed=23, count=12, vocab=tiny_model.vocab_size, max_prompt=70, max_output=8)
    requests = [InferenceRequest.from_values(i, p, m) for i, (p, m) in enumerate(specs)]
    client = StaggeredClient(requests, per_iteration=3)
    engine = {
        "max_batch_size": 8,
        "max_num_tokens": 24 if chunked else 128,
        "enable_chunked_context": chunked,
    }
    # the warm-up runs every shape class once by design (a chunk after a cached prefix too); what is
    # counted here is what the requests call
    model = dataclasses.replace(tiny_model, warmup="off")
    with BatchManager(make_config(engine=engine), client.get_requests, client.send_response, model=model):
        client.wait_or_fail()
    for i, (prompt, max_new) in enumerate(specs):
        assert client.results[i].output_ids == hf_greedy(tiny_reference, prompt, max_new), f"request {i}"
    if kernel.vectorized:
        assert calls["whole"] > 0
        assert (calls["after_prefix"] > 0) == chunked
