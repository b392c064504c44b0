"""The quantized linears' Triton GEMM (bm.runtime.triton.weight_ops), in Triton's interpreter: over the
panels the CPU kernels read, it computes each format's expanded weight (int8 rows, 4- and 8-bit groups,
FP8 codes) within rounding, in float32 and bfloat16; every quantized format bm reads runs it end to end
(``BM_QUANT_GEMM=triton``, as CUDA does) with greedy output equal to HF generate() on the expansion; and
the kernel compiles for an H100."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

import bm.runtime.triton.weight_ops as weight_ops
from bm.runtime import load_model
from bm.runtime.model_loader import ModelConfig, describe_model
from bm.runtime.native import GroupWeight
from bm.runtime.native.small_gemm import pack_panels
from bm.runtime.weight_quant import ENV_GEMM, quantize_weight, quantized_linears
from bm.runtime.weight_sources import weight_source
from tests.benchmark_scripts import load_benchmark
from tests.conftest import make_config, random_prompts, reference_model
from tests.quantized_oracle import assert_each_equals_hf
from tests.test_fp8_checkpoints import write_fp8_checkpoint
from tests.test_gguf_weights import write_gguf
from tests.test_int4_checkpoints import write_int4_checkpoint
from tests.test_oracle import run_staggered
from tests.triton_compile import compile_for_h100

# rows across the 16 / 32 / 64 row tiles, outputs not a multiple of a panel or of a 64-output tile, depths
# of one and several k tiles, and one that ends inside a k tile (int8 rows take any depth)
SHAPES = [(1, 40, 128), (5, 70, 64), (33, 16, 192), (70, 130, 256), (3, 24, 100)]


def _group_case(bits: int, group: int, float8: bool, n: int, k: int, g: torch.Generator) -> GroupWeight:
    if float8:
        u = (torch.randn(n, k, generator=g) * 40).to(torch.float8_e4m3fn).view(torch.uint8)
    elif bits == 4:
        u = torch.randint(0, 16, (n, k), generator=g)
    else:
        u = torch.randint(-128, 128, (n, k), generator=g)
    d = torch.rand(n, k // group, generator=g).half().float() / 8  # float16 steps, as every format stores
    m = -8 * d if bits == 4 else torch.zeros_like(d)
    return GroupWeight.pack(u, d, m, bits, group, float8)


def _assert_within_rounding(
    out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    scale: torch.Tensor | None = None,
):
    """``out`` is ``x @ weight.T (* scale) + bias``, the operands in ``x``'s dtype (``weight`` as it goes
    to the dot), summed in float32 in some order: within float32's rounding of the sum for float32, and
    one rounding of the output more otherwise."""
    x, weight = x.float(), weight.to(x.dtype).float()
    scale = torch.ones(weight.shape[0]) if scale is None else scale
    want = F.linear(x, weight) * scale + bias.to(out.dtype).float()
    size = F.linear(x.abs(), weight.abs()) * scale.abs() + bias.abs()
    assert out.shape == want.shape
    ulp = 0 if out.dtype == torch.float32 else 2**-7  # bf16's output rounding
    assert ((out.float() - want).abs() <= ulp * want.abs() + 1e-5 * size + 1e-6).all()


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gemm_over_int8_rows_computes_the_expanded_weight_scaled_after_each_sum(m, n, k, dtype):
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g)
    q, scale = quantize_weight(torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g))
    out = weight_ops.panel_linear(
        x, pack_panels(q), scale, None, bias.to(dtype), out_features=n, bits=8, group=None
    )
    # the integers go to the dot exactly (|q| <= 127 in bf16 too) and each sum is scaled after
    assert out.dtype == dtype
    _assert_within_rounding(out, x, q.float(), bias, scale)


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
@pytest.mark.parametrize(
    ("bits", "group", "float8"),
    [(4, 32, False), (4, 64, False), (4, 128, False), (8, 32, False), (8, 64, True), (8, None, True)],
    ids=["q4-g32", "q4-g64", "q4-g128", "q8-g32", "fp8-g64", "fp8-row"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gemm_over_group_panels_computes_the_expanded_weight(m, n, k, bits, group, float8, dtype):
    group = group or k  # one group a row: a per-channel FP8 scale
    if k % group or not weight_ops.serves(dtype, group):
        pytest.skip("the depth is not whole groups of a multiple of 32 (torch runs those)")
    g = torch.Generator().manual_seed(m * n + k + bits)
    weight = _group_case(bits, group, float8, n, k, g)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g)
    out = weight_ops.panel_linear(
        x, weight.values, weight.step, weight.offset, bias.to(dtype),
        out_features=n, bits=bits, group=group, float8=float8,
    )  # fmt: skip
    assert out.dtype == dtype
    _assert_within_rounding(out, x, weight.expanded(), bias)


def test_a_group_no_k_tile_divides_and_other_dtypes_are_left_to_torch():
    assert weight_ops.serves(torch.bfloat16, 128) and weight_ops.serves(torch.float32, None)
    assert not weight_ops.serves(torch.bfloat16, 48)  # a tile would hold two groups' steps
    assert not weight_ops.serves(torch.float64, 32)


def _gguf_model(folder):
    """The tiny Llama from a GGUF file of mixed formats (down Q8_0, v Q4_0, o kept F32, the rest Q4_1)."""
    base = load_model(ModelConfig(device="cpu", seed=0, prepack="off", fused_elementwise="off"))
    path = folder / "tiny.gguf"
    write_gguf(base.model, path, {"down_proj": "Q8_0", "v_proj": "Q4_0", "o_proj": "F32"})
    scheme, install = weight_source("gguf", device=base.device, dtype=base.dtype, sharded=False, gguf=path)
    return describe_model(
        base.model, base.tokenizer, "tiny.gguf", quantization=scheme, install_weights=install
    )


def _stored_model(write, layout):
    def build(folder):
        write(reference_model(load_model(ModelConfig(device="cpu", seed=0))), folder, layout)
        return load_model(ModelConfig(path=str(folder), device="cpu"))

    return build


# bm's model of each kind of weight the kernel reads (int8 rows; 4- and 8-bit groups of 32; 4-bit groups
# of 32 from another reader; FP8 codes a row); the formats' own tests pin how each weight expands
CASES = {
    "int8": lambda _: load_model(ModelConfig(device="cpu", seed=0, quantization="int8")),
    "gguf-q4_1-q4_0-q8_0": _gguf_model,
    "gptq": _stored_model(write_int4_checkpoint, "gptq"),
    "fp8-channel": _stored_model(write_fp8_checkpoint, "ct-channel"),
}


@pytest.mark.parametrize("case", CASES)
def test_each_quantized_format_runs_the_triton_gemm_and_matches_hf_generate(case, tmp_path, monkeypatch):
    """As on CUDA, every quantized linear runs the Triton GEMM (counted: none falls back to the C kernel
    or torch), and bm's greedy output equals HF generate() on the weights each format expands to."""
    loaded = CASES[case](tmp_path)
    reference = reference_model(loaded)
    calls = []
    launch = weight_ops.panel_linear
    monkeypatch.setattr(
        weight_ops, "panel_linear", lambda *a, **kw: calls.append(kw["bits"]) or launch(*a, **kw)
    )
    monkeypatch.setenv(ENV_GEMM, "triton")
    specs = random_prompts(seed=3, count=8, vocab=loaded.vocab_size, max_prompt=24, max_output=8)
    config = make_config(engine={"max_batch_size": 8, "max_num_tokens": 48}, kv_cache={"tokens_per_block": 4})
    client = run_staggered(loaded, config, specs)
    assert_each_equals_hf(client, specs, reference)
    steps = len(calls) // loaded.num_quantized_linears
    assert steps > 0 and len(calls) == steps * loaded.num_quantized_linears


def test_a_bad_gemm_switch_is_refused_naming_the_choices(monkeypatch, tmp_path):
    loaded = CASES["int8"](tmp_path)
    monkeypatch.setenv(ENV_GEMM, "cutlass")
    linear = quantized_linears(loaded.model)[0][1]
    with (
        pytest.raises(ValueError, match=r"BM_QUANT_GEMM='cutlass': allowed auto \(or unset\) and triton"),
        torch.no_grad(),
    ):
        linear(torch.zeros(1, linear.in_features))


def test_the_gpu_gemm_benchmark_runs_in_the_interpreter_and_reports_each_kernel_against_bf16(capsys):
    """benchmarks/quant_gemm_gpu.py, which the device run calls, cannot rot on the CPU."""
    report = load_benchmark("quant_gemm_gpu").main(["--device", "cpu", "--small", "--rows", "3"])
    assert json.loads(capsys.readouterr().out) == report
    runs = report["small"]["3"]
    assert set(runs) == {"bf16", "triton_int8", "triton_q4_g128", "triton_fp8_row"}  # no _scaled_mm on a CPU
    assert (
        all(r["ms"] > 0 and r["weight_gb_s"] > 0 for r in runs.values())
        and runs["bf16"]["speedup_vs_bf16"] == 1
    )


def test_the_panel_gemm_compiles_for_an_h100(tmp_path):
    """Each format and dtype the model runs, compiled to an sm_90 cubin (the interpreter forgives what
    the compiler refuses)."""
    args = "{'x_ptr': '*%s', 'x_stride': 'i32', 'w_ptr': '*%s', 'step_ptr': '*fp32', 'offset_ptr': '*fp32', 'bias_ptr': '*%s', 'out_ptr': '*%s', 'out_stride': 'i32', 'M': 'i32', 'N': 'i32', 'K': 'i32'}"
    consts = "{'GROUP': %d, 'BITS': %d, 'FLOAT8': %s, 'ROW_SCALE': %s, 'HAS_BIAS': True, 'DOT': %d, 'BLOCK_M': %d, 'BLOCK_N': 64, 'BLOCK_K': %d}"
    builds = [
        # (x dtype, weight dtype, group, bits, float8, row scale, DOT, BLOCK_M, BLOCK_K)
        ("bf16", "i8", 2048, 8, False, True, 0, 16, 64),
        ("fp32", "i8", 2048, 8, False, True, 1, 64, 64),
        ("bf16", "u8", 128, 4, False, False, 0, 64, 64),
        ("fp16", "u8", 32, 4, False, False, 0, 16, 32),
        ("fp32", "u8", 32, 4, False, False, 1, 32, 32),
        ("bf16", "u8", 32, 8, False, False, 0, 32, 32),
        ("bf16", "u8", 128, 8, True, False, 0, 64, 64),
    ]
    script = "".join(
        f"build(kernels.panel_linear_kernel, {args % (x, w, x, x)}, "
        f"{consts % (group, bits, float8, row, dot, block_m, block_k)})\n"
        for x, w, group, bits, float8, row, dot, block_m, block_k in builds
    )
    assert compile_for_h100("weight_kernels.py", script, tmp_path) == ["panel_linear_kernel"] * len(builds)
