"""A bf16 model's KV cache on the CPU: bf16 where the AVX-512 attention kernels read it, float32 elsewhere.

The bf16 kernels (``bm_paged_decode_bf16``, ``bm_prefill_attention_bf16``) widen each bf16 query, key
and value to float32 and then run the float32 kernels' own arithmetic, so their result must be, bit for
bit, the float32 kernel's on the widened inputs rounded to bf16: that is what these tests pin, for every
shape path (vector bodies, vector and scalar tails, soft-capping, ALiBi, windows, sinks). It follows that
a whole bf16 forward gives the same bits with the bf16 cache as with the float32 one it replaces, and
that the bf16 attention keeps the float32 kernels' batch invariance.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bm.batch_manager import BatchManager, InferenceRequest
from bm.cpu_isa import BF16_KV_ISAS, ENV_ISA
from bm.runtime import ModelRunner, load_model, native, work_item
from bm.runtime.attention import LayerExtras
from bm.runtime.model_loader import ModelConfig
from bm.runtime.native import DecodeRows, kv_cache_dtype, paged_decode_kernel, prefill_attention_kernel
from tests.clients import StaggeredClient
from tests.conftest import make_config, random_prompts
from tests.native_variants import ISAS, each_decode_extra, each_decode_shape, each_isa, scattered_tables

BF16_ISAS = [isa for isa in ISAS if isa in BF16_KV_ISAS]
needs_bf16_build = pytest.mark.skipif(
    not BF16_ISAS or paged_decode_kernel(BF16_ISAS[0]) is None,
    reason="this CPU runs no build with the bf16 attention kernels (AVX-512)",
)
each_bf16_isa = pytest.mark.parametrize("isa", BF16_ISAS)
BF16 = torch.bfloat16


def _rounded(x: torch.Tensor) -> torch.Tensor:
    """A float32 tensor of bf16 values (what a bf16 projection hands attention, widened exactly)."""
    return x.to(BF16).float()


def _paged(kv_heads, num_blocks, bs, d, lengths, g):
    """A cache of bf16 values and each row's blocks, scattered over it."""
    cache = _rounded(torch.randn(2, kv_heads, num_blocks, bs, d, generator=g) * 2)
    return cache, scattered_tables(lengths, num_blocks, bs, g)


@each_isa
def test_only_the_builds_in_bf16_kv_isas_have_the_bf16_attention_kernels(isa):
    decode, prefill = paged_decode_kernel(isa), prefill_attention_kernel(isa)
    if decode is None or prefill is None:
        pytest.skip("bm's C kernels do not build here")
    has = isa in BF16_KV_ISAS
    assert (BF16 in decode.dtypes, BF16 in prefill.dtypes) == (has, has)
    assert torch.float32 in decode.dtypes and torch.float32 in prefill.dtypes


@needs_bf16_build
@each_decode_shape
@each_bf16_isa
def test_bf16_decode_is_the_float32_kernel_on_the_widened_cache_rounded(
    heads, kv_heads, head_dim, block_size, isa
):
    kernel = paged_decode_kernel(isa)
    g = torch.Generator().manual_seed(heads * 100 + head_dim + block_size)
    lengths = [1, 2, block_size - 1 or 1, block_size + 1, 7 * block_size + 3, 9, 100, 333]
    cache, table = _paged(
        kv_heads, sum(-(-n // block_size) for n in lengths) + 3, block_size, head_dim, lengths, g
    )
    tokens = 12
    q = _rounded(torch.randn(tokens, heads, head_dim, generator=g)).transpose(0, 1)  # a strided view
    rows = DecodeRows(torch.tensor([3, 0, 11, 7, 8, 2, 1, 5]), table, torch.tensor(lengths), max(lengths))
    want = torch.full((tokens, heads, head_dim), float("nan"))
    kernel(want, q, cache, rows, head_dim**-0.5)
    got = torch.full((tokens, heads, head_dim), float("nan"), dtype=BF16)
    kernel(got, q.to(BF16), cache.to(BF16), rows, head_dim**-0.5)
    # exactly (rows not asked for stay NaN in both)
    torch.testing.assert_close(got, want.to(BF16), rtol=0, atol=0, equal_nan=True)


@needs_bf16_build
@each_decode_extra
@each_bf16_isa
def test_bf16_decode_extras_match_the_float32_kernel_bit_for_bit(softcap, alibi, window, sink, isa):
    kernel = paged_decode_kernel(isa)
    heads, kv_heads, d, bs = 8, 2, 32, 4
    g = torch.Generator().manual_seed(17)
    lengths = [1, 3, 4, 5, 13, 40, 9, 27]
    cache, table = _paged(kv_heads, 48, bs, d, lengths, g)
    q = _rounded(torch.randn(12, heads, d, generator=g)).transpose(0, 1)
    slopes = 2.0 ** (-torch.arange(1, heads + 1, dtype=torch.float32)) if alibi else None
    sinks = torch.randn(heads, generator=g) * 3 if sink else None
    rows = DecodeRows(
        torch.tensor([3, 0, 11, 7, 8, 2, 1, 5]), table, torch.tensor(lengths), max(lengths), window
    )
    extras = LayerExtras(softcap, slopes, sinks)
    want = torch.zeros(12, heads, d)
    kernel(want, q, cache, rows, 0.2, extras)
    got = torch.zeros(12, heads, d, dtype=BF16)
    kernel(got, q.to(BF16), cache.to(BF16), rows, 0.2, extras)
    assert torch.equal(got, want.to(BF16))


@needs_bf16_build
@each_bf16_isa
def test_bf16_decode_refuses_mixed_dtypes(isa):
    kernel = paged_decode_kernel(isa)
    cache = torch.zeros(2, 1, 2, 4, 16, dtype=BF16)
    rows = DecodeRows(torch.tensor([0]), torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]), 1)
    with pytest.raises(ValueError, match=r"expected torch\.bfloat16"):
        kernel(torch.zeros(1, 2, 16, dtype=BF16), torch.zeros(2, 1, 16), cache, rows, 1.0)


@needs_bf16_build
@pytest.mark.parametrize("tokens", [1, 7, 600])  # 600: past the size that splits the copy over threads
@each_bf16_isa
def test_bf16_kv_write_gives_the_cache_index_copy_gives(tokens, isa):
    write = paged_decode_kernel(isa)
    kv_heads, num_blocks, bs, d = 3, 64, 16, 40
    g = torch.Generator().manual_seed(tokens)
    cache = torch.randn(2, kv_heads, num_blocks, bs, d, generator=g).to(BF16)
    expected = cache.clone()
    slots = torch.randperm(num_blocks * bs, generator=g)[:tokens]
    k = torch.randn(tokens, kv_heads, d, generator=g).to(BF16).transpose(0, 1)
    v = torch.randn(tokens, kv_heads * d, generator=g).to(BF16).view(tokens, kv_heads, d).transpose(0, 1)
    flat = expected.view(2, kv_heads, num_blocks * bs, d)
    flat[0].index_copy_(1, slots, k)
    flat[1].index_copy_(1, slots, v)
    assert write.write_kv(cache, slots, k, v)
    assert torch.equal(cache, expected)
    assert not write.write_kv(cache, slots, k.float(), v.float())  # not the cache's dtype: torch copies


@needs_bf16_build
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128), (8, 4, 72), (6, 3, 24)])
@pytest.mark.parametrize(("prefix", "length"), [(0, 1), (0, 65), (0, 130), (15, 17), (70, 66)])
@each_bf16_isa
def test_bf16_prefill_is_the_float32_kernel_on_widened_inputs_rounded(
    heads, kv_heads, head_dim, prefix, length, isa
):
    kernel = prefill_attention_kernel(isa)
    g = torch.Generator().manual_seed(prefix * 31 + length + head_dim)
    bs, num_blocks = 8, 64
    ctx = prefix + length
    table = torch.randperm(num_blocks, generator=g)[: -(-ctx // bs)]
    cache = torch.full((2, kv_heads, num_blocks, bs, head_dim), float("nan"))
    keys = _rounded(torch.randn(2, kv_heads, ctx, head_dim, generator=g))
    slots = table[torch.arange(ctx) // bs] * bs + torch.arange(ctx) % bs
    cache.view(2, kv_heads, num_blocks * bs, head_dim)[:, :, slots] = keys
    start, tokens = 5, 5 + length + 2
    q = _rounded(torch.randn(tokens, heads, head_dim, generator=g)).transpose(0, 1)
    k = _rounded(torch.randn(tokens, kv_heads, head_dim, generator=g)).transpose(0, 1)
    v = _rounded(torch.randn(tokens, kv_heads, head_dim, generator=g)).transpose(0, 1)
    k[:, start : start + length] = keys[0, :, prefix:]
    v[:, start : start + length] = keys[1, :, prefix:]
    paged = (cache, table, prefix) if prefix else (None, None, 0)
    want = torch.zeros(tokens, heads, head_dim)
    kernel(want, q, k, v, start, start + length, 0.3, *paged)
    got = torch.zeros(tokens, heads, head_dim, dtype=BF16)
    bf = (cache.to(BF16), table, prefix) if prefix else (None, None, 0)
    kernel(got, q.to(BF16), k.to(BF16), v.to(BF16), start, start + length, 0.3, *bf)
    assert torch.equal(got, want.to(BF16))


@each_isa
def test_a_bf16_models_cache_is_bf16_exactly_where_the_build_reads_it(isa, monkeypatch):
    """The cache's dtype follows the attention kernels' build: bf16 (half the bytes a token takes, what
    the cache is sized by) under AVX-512, float32 under AVX2 and scalar; float32 models are untouched."""
    monkeypatch.setenv(ENV_ISA, isa if isa != "native" else "auto")
    cpu = torch.device("cpu")
    expected = BF16 if isa in BF16_KV_ISAS and paged_decode_kernel() is not None else torch.float32
    assert kv_cache_dtype(cpu, BF16) == expected
    assert kv_cache_dtype(cpu, torch.float32) == torch.float32
    assert kv_cache_dtype(cpu, torch.float16) == torch.float32
    assert kv_cache_dtype(torch.device("meta"), BF16) == BF16  # off the CPU: the model's dtype
    loaded = load_model(ModelConfig(device="cpu", dtype="bfloat16", seed=0))
    per_token = sum(2 * heads * dim for heads, dim in loaded.kv_shapes.values())
    assert loaded.kv_bytes_per_token == expected.itemsize * per_token
    runner = ModelRunner(loaded, 16, 8, 64)
    assert all(c.dtype == expected for c in runner.kv_caches if c is not None)
    if paged_decode_kernel() is not None:
        assert runner.backend.native_decode is not None  # read in place in either dtype
        assert native.runtime_info("cpu", BF16)["decode_attention"] == "native"


def test_native_kernels_off_keep_the_float32_cache(monkeypatch):
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    assert kv_cache_dtype(torch.device("cpu"), BF16) == torch.float32


@needs_bf16_build
def test_a_bf16_run_gives_the_same_bits_with_the_bf16_cache_as_with_the_float32_one(monkeypatch):
    """The bf16 kernels are the float32 ones on widened values, the KV write a copy, the output rounded as
    ``.to(bfloat16)`` rounds it: a whole engine run (chunked prompts, a cached prefix, decode rows) must
    not move one bit of its log probs or logits when the cache goes from float32 to bf16."""
    monkeypatch.setenv(ENV_ISA, BF16_ISAS[0])
    model = load_model(ModelConfig(device="cpu", dtype="bfloat16", seed=0))
    specs = random_prompts(seed=5, count=6, vocab=model.vocab_size, max_prompt=40, max_output=12)

    def run() -> tuple[torch.dtype, dict]:
        requests = [
            InferenceRequest.from_values(i, p, m, return_log_probs=True, return_generation_logits=True)
            for i, (p, m) in enumerate(specs)
        ]
        client = StaggeredClient(requests, per_iteration=2)
        config = make_config(engine={"enable_chunked_context": True, "max_num_tokens": 16})
        # a copy each time: engines over one loaded model share its executor, whose cache keeps the
        # dtype it was allocated with
        fresh = dataclasses.replace(model)
        with BatchManager(config, client.get_requests, client.send_response, model=fresh) as manager:
            client.wait_or_fail()
            dtype = manager.runner.kv_caches[0].dtype
        return dtype, client.results

    dtype, bf16_cache = run()
    assert dtype == BF16
    monkeypatch.setattr(native, "_bf16_attention_kernels", lambda: False)
    dtype, f32_cache = run()
    assert dtype == torch.float32
    for i in range(len(specs)):
        a, b = bf16_cache[i], f32_cache[i]
        assert a.output_ids == b.output_ids and a.output_log_probs == b.output_log_probs, f"request {i}"
        assert torch.equal(a.generation_logits, b.generation_logits), f"request {i}"


@needs_bf16_build
def test_the_runner_hands_attention_bf16_tensors_and_stores_bf16_keys(monkeypatch):
    """The forward's tensors reach the KV write and the kernels as the projections left them: no copies
    widened to float32 and back per layer (what a bf16 run spent 18% of its time on with the float32
    cache)."""
    from bm.runtime.backends.torch_backend import TorchBackend

    monkeypatch.setenv(ENV_ISA, BF16_ISAS[0])
    loaded = load_model(ModelConfig(device="cpu", dtype="bfloat16", seed=0))
    runner = ModelRunner(loaded, 16, 8, 64)
    seen = []
    real = TorchBackend.attend
    monkeypatch.setattr(
        TorchBackend, "attend", lambda self, m, call: seen.append(call.query.dtype) or real(self, m, call)
    )
    prompt = random_prompts(seed=2, count=1, vocab=loaded.vocab_size, max_prompt=20, max_output=1)[0][0]
    logits = runner.forward([work_item(prompt, 0, list(range(4)), True)])
    logits = runner.forward([work_item(prompt[:1], len(prompt), list(range(4)), True)])  # a decode row
    assert torch.isfinite(logits).all()
    assert seen and set(seen) == {BF16}
    cache = runner.kv_caches[0]
    assert cache.dtype == BF16 and cache[:, :, :1].abs().sum() > 0
