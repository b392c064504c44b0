"""The decoder layer's elementwise chains as Triton kernels (what a CUDA model runs), checked on CPU in
Triton's interpreter against transformers' own modules, and in a whole generation against HF
``generate()``.

In float32 the kernels match transformers to float rounding (the mean's summation order, ``exp``). In
bfloat16 the compiled kernels round each intermediate to the nearest bfloat16 as torch does, but
Triton 3.6's interpreter rounds a float32 -> bfloat16 cast differently (checked below), and the kernels
round up to three intermediates, so the bfloat16 checks here allow a few bfloat16 steps; ``benchmarks/gpu_check.py`` measures the compiled kernels on a GPU.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from transformers.models.llama import modeling_llama as llama

from bm.batch_manager import generate
from bm.config import ModelConfig
from bm.engine import Request
from bm.runtime import load_model
from bm.runtime.fusion import fuse_elementwise
from bm.runtime.triton.elementwise import TritonElementwise
from tests.conftest import hf_greedy, make_config, random_prompts, reference_model
from tests.triton_compile import compile_for_h100

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def kernels() -> TritonElementwise:
    return TritonElementwise("cpu")


def assert_close_to_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal to float32 rounding, or within a few bfloat16 steps (see the module's docstring)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = 2e-6 if want.dtype == torch.float32 else 2**-5
    scale = want.float().abs().clamp(min=1.0)
    assert ((got.float() - want.float()).abs() <= tol * scale).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_kernel_matches_transformers_llama_rms_norm(kernels, dtype):
    torch.manual_seed(0)
    norm = llama.LlamaRMSNorm(96, eps=1e-5).to(dtype)
    norm.weight.data = torch.randn(96).to(dtype)
    x = torch.randn(2, 7, 96).to(dtype)
    with torch.inference_mode():
        assert_close_to_rounding(kernels.rms_norm(x, norm.weight, 1e-5), norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_kernel_is_torch_add_then_the_norm(kernels, dtype):
    torch.manual_seed(1)
    norm = llama.LlamaRMSNorm(80, eps=1e-6).to(dtype)
    norm.weight.data = torch.randn(80).to(dtype)
    a, b = torch.randn(5, 80).to(dtype), torch.randn(5, 80).to(dtype)
    with torch.inference_mode():
        s, out = kernels.add_rms_norm(a, b, norm.weight, 1e-6)
        assert_close_to_rounding(s, a + b)
        assert_close_to_rounding(out, norm(a + b))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_kernel_matches_torch_across_column_blocks(kernels, dtype):
    torch.manual_seed(2)
    gate, up = torch.randn(3, 2500).to(dtype), torch.randn(3, 2500).to(dtype)  # 3 blocks, a tail
    with torch.inference_mode():
        assert_close_to_rounding(kernels.silu_mul(gate, up), torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 80])  # 80: a head size that is not a power of two
def test_rotary_kernel_matches_transformers_apply_rotary_pos_emb(kernels, dtype, head_dim):
    torch.manual_seed(3)
    q = torch.randn(1, 6, 5, head_dim).to(dtype)  # 6 heads (not a power of two), 5 tokens
    k = torch.randn(1, 2, 5, head_dim).to(dtype)
    cos, sin = torch.randn(1, 5, head_dim).to(dtype), torch.randn(1, 5, head_dim).to(dtype)
    want_q, want_k = llama.apply_rotary_pos_emb(q, k, cos, sin)
    with torch.inference_mode():
        got_q = kernels.rotary(q[0].transpose(0, 1), cos[0], sin[0]).transpose(0, 1)[None]
        got_k = kernels.rotary(k[0].transpose(0, 1), cos[0], sin[0]).transpose(0, 1)[None]
    if dtype == torch.float32:  # each product, then the sum, rounded as torch rounds them
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert_close_to_rounding(got_q, want_q)
    assert_close_to_rounding(got_k, want_k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_pair_is_one_launch_with_the_bits_of_two(kernels, dtype, monkeypatch):
    """Queries and keys in one launch (the GPU path's), bit for bit what one launch each gives, for
    strided views as a stacked q/k/v product hands them over (6 query heads and 2 key heads of 80)."""
    torch.manual_seed(4)
    qkv = torch.randn(5, 10 * 80).to(dtype)  # 5 tokens: 6 query, 2 key and 2 value heads, side by side
    q, k = qkv[:, : 6 * 80].view(5, 6, 80), qkv[:, 6 * 80 : 8 * 80].view(5, 2, 80)
    cos, sin = torch.randn(5, 80).to(dtype), torch.randn(5, 80).to(dtype)
    launches = []
    pair = kernels._k.rotary_pair_kernel
    monkeypatch.setattr(kernels._k, "rotary_pair_kernel", _Counted(pair, launches))
    with torch.inference_mode():
        got_q, got_k = kernels.rotary_pair(q, k, cos, sin)
        want_q, want_k = kernels.rotary(q, cos, sin), kernels.rotary(k, cos, sin)
    assert len(launches) == 1
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_store_kv_gives_the_queries_and_the_cache_the_bits_of_rotary_pair_then_store_kv(
    kernels, dtype, monkeypatch
):
    """The GPU path's fused launch: queries rotated, keys rotated and stored with the values, for views of a
    stacked q/k/v product (6 query heads, 2 KV heads of 80), slots in scattered blocks and a padding row
    (slot -1) that stores nothing; the cache elsewhere untouched."""
    from bm.runtime.triton.ops import store_kv

    torch.manual_seed(5)
    tokens, d = 5, 80
    qkv = torch.randn(tokens, 10 * d).to(dtype)
    q, k = qkv[:, : 6 * d].view(tokens, 6, d), qkv[:, 6 * d : 8 * d].view(tokens, 2, d)
    v = qkv[:, 8 * d :].view(tokens, 2, d)
    cos, sin = torch.randn(tokens, d).to(dtype), torch.randn(tokens, d).to(dtype)
    slots = torch.tensor([13, 2, -1, 30, 7], dtype=torch.int32)  # blocks of 8 tokens
    empty = torch.randn(2, 2, 4, 8, d).to(dtype)
    launches = []
    fused = kernels._k.rotary_store_kv_kernel
    monkeypatch.setattr(kernels._k, "rotary_store_kv_kernel", _Counted(fused, launches))
    with torch.inference_mode():
        cache = empty.clone()
        got_q = kernels.rotary_store_kv(q, k, v, cos, sin, cache, slots)
        want_q, want_k = kernels.rotary_pair(q, k, cos, sin)
        want = empty.clone()
        store_kv(want, want_k.transpose(0, 1), v.transpose(0, 1), slots)
    assert len(launches) == 1
    assert torch.equal(got_q, want_q)
    assert torch.equal(cache, want)
    assert not torch.equal(cache, empty)  # something was stored


def test_rotary_store_kv_refuses_a_cache_of_another_dtype_or_shape(kernels):
    q, k = torch.randn(3, 4, 16), torch.randn(3, 2, 16)
    cos = sin = torch.randn(3, 16)
    slots = torch.arange(3, dtype=torch.int32)
    for cache in (torch.zeros(2, 2, 2, 4, 16, dtype=torch.bfloat16), torch.zeros(2, 3, 2, 4, 16)):
        with pytest.raises(ValueError, match="rotary KV-store kernel"):
            kernels.rotary_store_kv(q, k, k, cos, sin, cache, slots)


class _Counted:
    """A kernel whose launches (``kernel[grid](...)``) are recorded."""

    def __init__(self, kernel, launches: list) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        self.launches.append(grid)
        return self.kernel[grid]


def test_kernels_accept_only_their_device_one_dtype_and_no_autograd(kernels):
    x = torch.zeros(2, 4)
    assert not kernels.accepts(x)  # autograd on (pytest's default)
    with torch.no_grad():
        assert kernels.accepts(x, torch.zeros(4))
        assert kernels.accepts(x.to(torch.bfloat16))
        assert not kernels.accepts(x, torch.zeros(4, dtype=torch.bfloat16))  # mixed dtypes
        assert not kernels.accepts(torch.zeros(2, 4, dtype=torch.float64))
        assert not TritonElementwise("cuda").accepts(x)  # a CPU tensor for the CUDA kernels


def test_interpreter_rounds_bfloat16_casts_unlike_torch_which_is_why_bf16_checks_allow_one_step():
    """If a later Triton rounds like torch, the bfloat16 checks above can be made exact."""
    import triton
    import triton.language as tl

    @triton.jit
    def cast(x_ptr, out_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(out_ptr + offs, tl.load(x_ptr + offs).to(tl.bfloat16))

    x = torch.randn(256, generator=torch.Generator().manual_seed(0))
    out = torch.empty(256, dtype=torch.bfloat16)
    cast[(1,)](x, out, N=256)
    assert (out.float() - x.to(torch.bfloat16).float()).abs().max() <= 2**-7 * x.abs().max()


def test_greedy_output_equals_hf_generate_with_the_triton_elementwise_chains_fused(
    threads, triton_rotary_on_cpu
):
    threads(1)
    # prepack off: no packed GEMMs, so the MLP runs gate, up, then the SiLU-mul kernel, as on a GPU
    loaded = load_model(ModelConfig(device="cpu", seed=0, fused_elementwise="off", prepack="off"))
    reference = reference_model(loaded)
    counts = fuse_elementwise(loaded.model, TritonElementwise("cpu"))
    layers = loaded.model.config.num_hidden_layers
    assert counts == {"rms_norm": 2 * layers + 1, "mlp": layers, "rotary": 1, "decoder_layer": layers}
    specs = random_prompts(seed=11, count=6, vocab=loaded.vocab_size, max_prompt=24, max_output=6)
    config = make_config(engine={"max_batch_size": 4, "max_num_tokens": 32, "enable_chunked_context": True})
    results = generate([Request(i, p, m) for i, (p, m) in enumerate(specs)], config, model=loaded)
    for i, (prompt, max_new) in enumerate(specs):
        assert not results[i].error, results[i].error
        assert results[i].output_ids == hf_greedy(reference, prompt, max_new), f"request {i}"


# Compiled for an H100 (tests/triton_compile.py): these kernels run compiled only on a GPU, which CI has
# not, and the interpreter forgives what the compiler refuses.
_BUILDS = """
rotary = {"cos_ptr": "*bf16", "sin_ptr": "*bf16"}
build(kernels.rotary_pair_kernel,
      {"q_ptr": "*bf16", "q_stride_t": "i32", "q_stride_h": "i32", "k_ptr": "*bf16", "k_stride_t": "i32",
       "k_stride_h": "i32", **rotary, "q_out_ptr": "*bf16", "k_out_ptr": "*bf16", "q_heads": "i32", "k_heads": "i32"},
      {"HEAD_DIM": 64, "HEAD_PAD": 64, "BLOCK_HQ": 32, "BLOCK_HK": 8})
for cache, quant in (("bf16", 0), ("i8", 1), ("fp8e4nv", 2)):  # full width, int8 rows, fp8
    build(kernels.rotary_store_kv_kernel,
          {"q_ptr": "*bf16", "q_stride_t": "i32", "q_stride_h": "i32", "k_ptr": "*bf16", "k_stride_t": "i32",
           "k_stride_h": "i32", "v_ptr": "*bf16", "v_stride_t": "i32", "v_stride_h": "i32", **rotary,
           "q_out_ptr": "*bf16", "k_cache_ptr": f"*{cache}", "v_cache_ptr": f"*{cache}", "slot_mapping_ptr": "*i32",
           "c_stride_h": "i32", "c_stride_b": "i32", "c_stride_t": "i32", "q_heads": "i32", "k_heads": "i32",
           "k_scale": "fp32", "v_scale": "fp32"},
          {"TOKENS_PER_BLOCK": 32, "HEAD_DIM": 64, "HEAD_PAD": 64, "BLOCK_HQ": 32, "BLOCK_HK": 8, "KV_QUANT": quant})
build(kernels.rotary_kernel,
      {"x_ptr": "*bf16", "x_stride_t": "i32", "x_stride_h": "i32", **rotary, "out_ptr": "*bf16", "heads": "i32"},
      {"HEAD_DIM": 80, "HEAD_PAD": 128, "BLOCK_H": 8})
for add in (False, True):
    build(kernels.rms_norm_kernel,
          {"x_ptr": "*bf16", "x_stride": "i32", "b_ptr": "*bf16", "b_stride": "i32", "w_ptr": "*bf16",
           "sum_ptr": "*bf16", "out_ptr": "*bf16", "cols": "i32", "eps": "fp32"}, {"BLOCK": 2048, "ADD": add})
build(kernels.silu_mul_kernel,
      {"g_ptr": "*bf16", "g_stride": "i32", "u_ptr": "*bf16", "u_stride": "i32", "out_ptr": "*bf16", "cols": "i32"},
      {"BLOCK": 1024})
"""


def test_elementwise_kernels_compile_for_an_h100_without_one(tmp_path):
    assert compile_for_h100("elementwise_kernels.py", _BUILDS, tmp_path) == [
        "rotary_pair_kernel", *["rotary_store_kv_kernel"] * 3, "rotary_kernel", "rms_norm_kernel",
        "rms_norm_kernel", "silu_mul_kernel",
    ]  # fmt: skip
