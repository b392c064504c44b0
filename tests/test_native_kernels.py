"""The compiled paged decode kernel: same attention as torch, same engine output as the torch path."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bm.batch_manager import BatchManager, InferenceRequest
from bm.runtime import ModelRunner
from bm.runtime.attention import LayerExtras
from bm.runtime.native import ENV_SWITCH, DecodeRows, paged_decode_kernel
from tests.clients import StaggeredClient
from tests.conftest import hf_greedy, make_config, random_prompts
from tests.native_variants import ISAS, each_isa, scattered_tables

kernel = paged_decode_kernel()
needs_kernel = pytest.mark.skipif(kernel is None, reason="no C compiler here: bm runs the torch path")


def reference_decode(
    q, cache, token_index, tables, lengths, scaling, softcap=None, alibi=None, window=None, sinks=None
):
    """Plain torch: each row's keys gathered block by block, softmax over exactly its length (its last
    ``window`` keys), scores soft-capped and ALiBi-biased as written in the Gemma 2 and BLOOM papers."""
    heads = q.shape[0]
    kv_heads, _, block_size, _ = cache.shape[1:]
    out = {}
    for row, tok in enumerate(token_index.tolist()):
        n = int(lengths[row])
        blocks = tables[row][: -(-n // block_size)]
        k = cache[0][:, blocks].reshape(kv_heads, -1, cache.shape[-1])[:, :n]
        v = cache[1][:, blocks].reshape(kv_heads, -1, cache.shape[-1])[:, :n]
        k = k.repeat_interleave(heads // kv_heads, 0)
        v = v.repeat_interleave(heads // kv_heads, 0)
        scores = (q[:, tok, None, :] @ k.transpose(1, 2)).squeeze(1) * scaling  # [heads, n]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        if alibi is not None:
            scores = scores + alibi[:, None] * (torch.arange(n) - (n - 1))[None, :]
        if window is not None:
            scores[:, : max(0, n - window)] = float("-inf")
        if sinks is not None:  # gpt-oss: a per-head logit that takes probability and gives no value
            probs = torch.cat([scores, sinks[:, None]], 1).softmax(-1)[:, :-1]
        else:
            probs = scores.softmax(-1)
        out[tok] = probs[:, None, :].matmul(v).squeeze(1)  # [heads, d]
    return out


@pytest.fixture(scope="module")
def own_threads_kernel():
    """The build used where torch's OpenMP runtime cannot be found: the kernel starts its own threads."""
    from bm.runtime import native
    from bm.runtime.native import build, loader

    saved_loaded, saved_finder = loader._loaded, build.loaded_openmp_runtime
    loader._loaded, build.loaded_openmp_runtime = {}, lambda: None
    try:
        return native.paged_decode_kernel()
    finally:  # later tests see the process's usual kernel again
        loader._loaded, build.loaded_openmp_runtime = saved_loaded, saved_finder


@needs_kernel
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(6, 2, 64, 32), (4, 4, 16, 8), (6, 3, 12, 4), (8, 1, 40, 16)],  # 12 and 40: the non-vector tail
)
@pytest.mark.parametrize("build", [*[f"torch_openmp-{isa}" for isa in ISAS], "own_threads"])
def test_native_decode_matches_torch_attention(heads, kv_heads, head_dim, block_size, build, request):
    kernel = (
        paged_decode_kernel(build.split("-")[1])
        if build.startswith("torch_openmp")
        else request.getfixturevalue("own_threads_kernel")
    )
    assert kernel is not None
    g = torch.Generator().manual_seed(heads * 100 + head_dim)
    num_blocks = 64
    cache = torch.randn(2, kv_heads, num_blocks, block_size, head_dim, generator=g)
    lengths = [1, 2, block_size - 1, block_size, block_size + 1, 7 * block_size + 3, 9, 100]
    table = scattered_tables(lengths, num_blocks, block_size, g)
    tokens = 20
    # [heads, tokens, d] as a transposed view of [tokens, heads, d], the way transformers hands it over
    q = torch.randn(tokens, heads, head_dim, generator=g).transpose(0, 1)
    token_index = torch.tensor([3, 0, 19, 7, 8, 12, 1, 15])
    out = torch.full((tokens, heads, head_dim), float("nan"))
    scaling = head_dim**-0.5
    kernel(out, q, cache, DecodeRows(token_index, table, torch.tensor(lengths), max(lengths)), scaling)
    expected = reference_decode(q, cache, token_index, table.tolist(), lengths, scaling)
    for tok, want in expected.items():
        torch.testing.assert_close(out[tok], want, rtol=1e-5, atol=1e-5)
    untouched = sorted(set(range(tokens)) - set(token_index.tolist()))
    assert torch.isnan(out[untouched]).all()  # rows not asked for are never written


@needs_kernel
@pytest.mark.parametrize(
    ("softcap", "alibi", "window", "sink"),
    [
        (2.0, False, None, False),
        (None, True, None, False),
        (None, False, 5, False),
        (None, True, 11, False),
        (0.5, False, 9, False),
        (None, False, 6, True),
    ],
)
@each_isa
def test_native_decode_softcap_alibi_window_and_sinks_match_direct_attention(
    softcap, alibi, window, sink, isa
):
    """Scores soft-capped (Gemma 2), ALiBi-biased (bloom/mpt/falcon), with sink logits (gpt-oss), or
    limited to the last ``window`` keys; under a window the blocks wholly before it are never read (released ones hold NaN here)."""
    heads, kv_heads, head_dim, bs = 8, 2, 32, 4
    g = torch.Generator().manual_seed(7)
    num_blocks = 48
    cache = torch.randn(2, kv_heads, num_blocks, bs, head_dim, generator=g) * 3  # large scores: softcap bites
    lengths = [1, 3, 4, 5, 13, 40, 9, 27]
    table = scattered_tables(lengths, num_blocks, bs, g)
    if window is not None:  # blocks wholly before the window are released: poison and unlink them
        for row, n in enumerate(lengths):
            for b in range(max(0, n - window) // bs):
                cache[:, :, table[row, b]] = float("nan")
                table[row, b] = -1
    q = torch.randn(12, heads, head_dim, generator=g).transpose(0, 1)
    token_index = torch.tensor([3, 0, 11, 7, 8, 2, 1, 5])
    slopes = 2.0 ** (-torch.arange(1, heads + 1, dtype=torch.float32)) if alibi else None
    out = torch.full((12, heads, head_dim), float("nan"))
    scaling = head_dim**-0.5
    sinks = torch.randn(heads, generator=g) * 3 if sink else None
    kernel = paged_decode_kernel(isa)
    rows = DecodeRows(token_index, table, torch.tensor(lengths), max(lengths), window)
    kernel(out, q, cache, rows, scaling, LayerExtras(softcap, slopes, sinks))
    safe = torch.nan_to_num(cache)  # the reference reads every key, then masks those outside the window
    expected = reference_decode(q, safe, token_index, table.clamp(min=0).tolist(), lengths, scaling,
                                softcap, slopes, window, sinks)  # fmt: skip
    for tok, want in expected.items():
        torch.testing.assert_close(out[tok], want, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_runner_uses_native_decode_for_fp32_cpu_caches(tiny_model):
    runner = ModelRunner(tiny_model, num_blocks=16, tokens_per_block=8, max_seq_len=64)
    assert runner.backend.native_decode is kernel


def test_env_switch_turns_native_kernels_off(tiny_model, monkeypatch):
    monkeypatch.setenv(ENV_SWITCH, "0")
    assert paged_decode_kernel() is None
    runner = ModelRunner(tiny_model, num_blocks=16, tokens_per_block=8, max_seq_len=64)
    assert runner.backend.native_decode is None


@pytest.mark.parametrize("native", ["1", "0"])
def test_greedy_output_equals_hf_generate_with_and_without_native_decode(
    tiny_model, tiny_reference, monkeypatch, native
):
    monkeypatch.setenv(ENV_SWITCH, native)
    specs = random_prompts(seed=11, count=16, vocab=tiny_model.vocab_size, max_prompt=40, max_output=20)
    requests = [InferenceRequest.from_values(i, p, m) for i, (p, m) in enumerate(specs)]
    client = StaggeredClient(requests, per_iteration=3)
    config = make_config(engine={"max_batch_size": 8, "max_num_tokens": 96})
    # a copy of the model: engines over one loaded model share its executor, whose runner chose its
    # decode kernel when the first of them bound it (the switch is read once per runner)
    model = dataclasses.replace(tiny_model)
    with BatchManager(config, client.get_requests, client.send_response, model=model) as manager:
        client.wait_or_fail()
        runner_native = manager.runner.backend.native_decode is not None
    assert runner_native == (native == "1" and kernel is not None)
    for i, (prompt, max_new) in enumerate(specs):
        assert client.results[i].output_ids == hf_greedy(tiny_reference, prompt, max_new), f"request {i}"


def test_a_failing_compiler_leaves_the_torch_path(monkeypatch):
    from bm.runtime import native
    from bm.runtime.native import loader

    monkeypatch.setenv(ENV_SWITCH, "1")
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(loader, "_loaded", {})
    assert native.paged_decode_kernel() is None


@needs_kernel
def test_the_kernel_is_compiled_once_per_machine_then_loaded_from_the_cache(monkeypatch, tmp_path):
    from bm.runtime import native
    from bm.runtime.native import build, loader

    monkeypatch.setenv(ENV_SWITCH, "1")
    monkeypatch.setenv("BM_CACHE_DIR", str(tmp_path))
    compiles = []
    real = build._run_compiler
    monkeypatch.setattr(build, "_run_compiler", lambda cmd: compiles.append(cmd) or real(cmd))
    monkeypatch.setattr(loader, "_loaded", {})
    assert native.paged_decode_kernel() is not None
    built = len(compiles)
    assert built > 0
    assert [p.suffix for p in (tmp_path / "kernels").iterdir()] == [".so"]  # no temporary files left
    monkeypatch.setattr(loader, "_loaded", {})  # as a new run on the same machine
    assert native.paged_decode_kernel() is not None
    assert len(compiles) == built


@needs_kernel
def test_an_unwritable_kernel_cache_still_gives_a_kernel_for_this_process(monkeypatch, tmp_path):
    from bm.runtime import native
    from bm.runtime.native import loader

    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv(ENV_SWITCH, "1")
    monkeypatch.setenv("BM_CACHE_DIR", str(blocker))
    monkeypatch.setattr(loader, "_loaded", {})
    assert native.paged_decode_kernel() is not None


@needs_kernel
def test_kernel_refuses_shapes_it_would_read_out_of_bounds():
    cache = torch.zeros(2, 2, 4, 8, 16)
    q = torch.zeros(6, 3, 32)  # head size 32 against the cache's 16
    out = torch.zeros(3, 6, 32)
    idx = torch.tensor([0])
    with pytest.raises(ValueError, match="head size"):
        kernel(out, q, cache, DecodeRows(idx, torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]), 1), 1.0)


@needs_kernel
@pytest.mark.parametrize("tokens", [1, 7, 600])  # 600 x 3 heads x 40: past the size that splits threads
@each_isa
def test_kv_write_kernel_gives_the_cache_index_copy_gives(tokens, isa):
    """The compiled KV write against the two index_copy_ calls it replaces, bit for bit, from the strided
    views transformers hands over (keys after rotary [tokens, heads, d] transposed, values the
    projection's [tokens, heads * d] viewed per head)."""
    write = paged_decode_kernel(isa)
    kv_heads, num_blocks, bs, d = 3, 64, 16, 40
    g = torch.Generator().manual_seed(tokens)
    cache = torch.randn(2, kv_heads, num_blocks, bs, d, generator=g)
    expected = cache.clone()
    slots = torch.randperm(num_blocks * bs, generator=g)[:tokens]
    k = torch.randn(tokens, kv_heads, d, generator=g).transpose(0, 1)
    v = torch.randn(tokens, kv_heads * d, generator=g).view(tokens, kv_heads, d).transpose(0, 1)
    flat = expected.view(2, kv_heads, num_blocks * bs, d)
    flat[0].index_copy_(1, slots, k)
    flat[1].index_copy_(1, slots, v)
    assert write.write_kv(cache, slots, k, v)
    assert torch.equal(cache, expected)


@needs_kernel
def test_kv_write_kernel_refuses_a_slot_outside_the_cache_and_declines_other_dtypes():
    cache = torch.zeros(2, 1, 2, 4, 8)
    k = torch.ones(1, 2, 8)
    with pytest.raises(IndexError, match="outside the cache"):
        kernel.write_kv(cache, torch.tensor([3, 8]), k, k)
    assert torch.equal(cache, torch.zeros_like(cache))  # nothing written
    assert not kernel.write_kv(cache, torch.tensor([0, 1]), k.double(), k.double())  # the caller copies


@pytest.mark.parametrize(
    ("rows", "n", "k"), [(1, 16, 8), (5, 50, 33), (6, 96, 64), (13, 7, 40), (200, 130, 72)]
)
@pytest.mark.parametrize("with_bias", [True, False])
@each_isa
def test_panel_gemm_matches_torch_linear(rows, n, k, with_bias, isa):
    from bm.runtime.native import SmallGemmKernel, small_gemm_kernel

    kernel = small_gemm_kernel(isa)
    if kernel is None:
        pytest.skip(f"the panel GEMM needs a C compiler and AVX2/FMA (this build: {isa})")
    torch.manual_seed(rows * n + k)
    weight, bias = torch.randn(n, k), torch.randn(n) if with_bias else None
    x = torch.randn(2, rows, k + 3)[:, :, 1 : k + 1]  # strided rows: not contiguous
    got = kernel(x, SmallGemmKernel.pack(weight), bias, n)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_panel_gemm_refuses_a_weight_packed_for_another_shape():
    from bm.runtime.native import SmallGemmKernel, small_gemm_kernel

    kernel = small_gemm_kernel()
    if kernel is None:
        pytest.skip("the panel GEMM needs a C compiler and AVX2/FMA")
    packed = SmallGemmKernel.pack(torch.randn(32, 8))
    with pytest.raises(ValueError, match="small GEMM"):
        kernel(torch.randn(3, 9), packed, None, 32)
    with pytest.raises(ValueError, match="do not fit"):
        kernel(torch.randn(3, 8), packed, None, 48)


def test_the_avx512_and_avx2_panel_gemms_give_the_same_bits():
    """Both sum each output over k in one FMA chain, in order; only the tiles differ. So switching the
    instruction set never changes a result (the elementwise and attention builds may, by rounding)."""
    from bm.runtime.native import SmallGemmKernel, small_gemm_kernel

    if not {"avx512", "avx2"} <= set(ISAS) or small_gemm_kernel("avx512") is None:
        pytest.skip("needs a CPU with AVX-512 and a C compiler")
    torch.manual_seed(0)
    weight, bias = torch.randn(200, 96), torch.randn(200)
    packed = SmallGemmKernel.pack(weight)
    for rows in (1, 7, 12, 13, 25, 200):
        x = torch.randn(rows, 96)
        wide = small_gemm_kernel("avx512")(x, packed, bias, 200)
        assert torch.equal(wide, small_gemm_kernel("avx2")(x, packed, bias, 200)), f"{rows} rows"


@each_isa
def test_a_panel_gemm_rows_result_does_not_depend_on_the_batch(isa):
    from bm.runtime.native import SmallGemmKernel, small_gemm_kernel

    kernel = small_gemm_kernel(isa)
    if kernel is None:
        pytest.skip(f"the panel GEMM needs a C compiler and AVX2/FMA (this build: {isa})")
    torch.manual_seed(1)
    weight = torch.randn(72, 40)
    packed = SmallGemmKernel.pack(weight)
    x = torch.randn(150, 40)
    batch = kernel(x, packed, None, 72)
    for rows in (slice(0, 1), slice(5, 18), slice(140, 150), slice(13, 14)):
        assert torch.equal(kernel(x[rows], packed, None, 72), batch[rows]), rows
