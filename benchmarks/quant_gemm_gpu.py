#!/usr/bin/env python3
"""bm's quantized-weight Triton GEMM against cuBLAS in bf16 and torch's FP8 GEMM, on a model's layers.

    python benchmarks/quant_gemm_gpu.py [--shapes llama-1b,llama-8b] [--rows 1,16,64,256] [--out F.json]
    python benchmarks/quant_gemm_gpu.py --device cpu --small     # Triton's interpreter, tiny (tests)

Per shape (one decoder layer's linears: q, k, v, o, gate, up, down as N x K) and row count M, the
median of CUDA-event-timed calls summed over the layer's linears, for:

* ``bf16``: ``F.linear`` in bf16 (cuBLAS), what a bf16 model runs;
* ``triton_int8``: bm's panel GEMM over int8 rows (``model.quantization: int8``);
* ``triton_q4_g128``: the same kernel over 4-bit groups of 128 (GPTQ and AWQ checkpoints);
* ``triton_fp8_row``: the same kernel over e4m3 codes with a scale per output (FP8 checkpoints);
* ``scaled_mm_fp8``: ``torch._scaled_mm`` with e4m3 weights and activations quantized per tensor on each
  call (the library route the issue asks to measure first; sm_89 and later).

Each with its weight bytes over its time (``weight_gb_s``) and that against the copy bandwidth measured
in the same run (``fraction_of_copy``): decode is bound by the bytes it reads. Prints and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import copy_bandwidth

from bm.runtime.group_linears import fp8_rows
from bm.runtime.native import GroupWeight
from bm.runtime.native.small_gemm import pack_panels
from bm.runtime.triton.weight_ops import panel_linear
from bm.runtime.weight_quant import quantize_weight

# hidden, intermediate, heads, kv heads (head size 128 for the Llamas, 64 for SmolLM2)
SHAPES = {
    "llama-1b": (2048, 8192, 32, 8, 64),
    "llama-8b": (4096, 14336, 32, 8, 128),
    "smollm2-135m": (576, 1536, 9, 3, 64),
}
SMALL = {"small": (64, 128, 4, 2, 16)}


def layer_linears(hidden: int, inter: int, heads: int, kv_heads: int, head: int) -> list[tuple[int, int]]:
    """One decoder layer's linears as (N, K)."""
    q, kv = heads * head, kv_heads * head
    return [
        (q, hidden),
        (kv, hidden),
        (kv, hidden),
        (hidden, q),
        (inter, hidden),
        (inter, hidden),
        (hidden, inter),
    ]


def q4_groups(w: torch.Tensor, group: int) -> GroupWeight:
    """``w`` as asymmetric 4-bit groups (GPTQ's and AWQ's arithmetic): ``u * d + m``."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    low, high = g.amin(-1), g.amax(-1)
    d = ((high - low) / 15).clamp_min(1e-8).half().float()
    u = torch.clamp(torch.round((g - low[..., None]) / d[..., None]), 0, 15).reshape(n, k)
    return GroupWeight.pack(u, d, low.half().float(), 4, group)


def install_int4_like(model: torch.nn.Module) -> int:
    """Give each decoder linear of a random-weight ``model`` its weight as an int4 checkpoint (GPTQ,
    AWQ) would hold it, in groups of 128 (32 where 128 does not divide a row), on bm's group format
    (gpu_check's ``--quantization int4``; FP8 and int8 are bm's own quantization on load); returns how
    many."""
    from bm.runtime.group_linears import install_group_weight
    from bm.runtime.weight_quant import quantized_linears

    linears = quantized_linears(model)
    for _, linear in linears:
        w = linear.weight.detach().float()
        install_group_weight(linear, q4_groups(w, 128 if w.shape[1] % 128 == 0 else 32))
    return len(linears)


def timed(fn, device: torch.device, reps: int) -> float:
    """Median milliseconds of ``reps`` calls after warm-up (CUDA events on a GPU)."""
    for _ in range(3 if reps > 2 else 1):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def runs_for(n: int, k: int, device: torch.device) -> dict[str, tuple]:
    """Each way to run one (N, K) linear: (callable on x, its weight bytes)."""
    w = torch.randn(n, k, device=device) * 0.02
    wb = w.bfloat16()
    q, scale = quantize_weight(w)
    int8 = pack_panels(q)
    q4 = q4_groups(w, 128 if k % 128 == 0 else 32)
    fp8 = fp8_rows(w)
    runs = {
        "bf16": (lambda x: F.linear(x, wb), 2 * n * k),
        "triton_int8": (
            lambda x: panel_linear(x, int8, scale, None, None, out_features=n, bits=8, group=None),
            n * k + 4 * n,
        ),
        "triton_q4_g128": (
            lambda x: panel_linear(
                x, q4.values, q4.step, q4.offset, None, out_features=n, bits=4, group=q4.group
            ),
            n * k // 2 + 8 * n * k // q4.group,
        ),
        "triton_fp8_row": (
            lambda x: panel_linear(
                x, fp8.values, fp8.step, fp8.offset, None, out_features=n, bits=8, group=k, float8=True
            ),
            n * k + 8 * n,
        ),
    }
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
        w8 = (w / (w.abs().max() / 448)).to(torch.float8_e4m3fn)
        w_scale = (w.abs().max() / 448).float()

        def scaled_mm(x: torch.Tensor) -> torch.Tensor:
            x_scale = (x.abs().max().float() / 448).clamp_min(1e-12)
            x8 = (x / x_scale).to(torch.float8_e4m3fn)
            return torch._scaled_mm(x8, w8.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=torch.bfloat16)

        runs["scaled_mm_fp8"] = (scaled_mm, n * k)
    return runs


def _sig(x: float) -> float:
    """Four significant digits (the interpreter's figures are tiny, a GPU's large)."""
    return float(f"{x:.4g}")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="a tiny layer, few reps (the interpreter, tests)")
    p.add_argument("--shapes", default="llama-1b,llama-8b,smollm2-135m")
    p.add_argument("--rows", default="1,16,64,256")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    shapes = SMALL if args.small else {s: SHAPES[s] for s in args.shapes.split(",")}
    rows = [int(r) for r in args.rows.split(",")]
    reps = 1 if args.small else args.reps
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"}
    report["copy_bandwidth_gb_s"] = round(copy_bandwidth(device, small=args.small) / 1e9, 1)
    torch.manual_seed(0)
    for name, shape in shapes.items():
        linears = [runs_for(n, k, device) for n, k in layer_linears(*shape)]
        rows_out = {}
        for m in rows:
            xs = {k: torch.randn(m, k, device=device).bfloat16() for _, k in layer_linears(*shape)}
            per = {}
            for run in linears[0]:
                try:  # a library kernel may refuse a shape (torch._scaled_mm wants rows in 16s on some builds)
                    ms = sum(
                        timed(lambda r=lin[run][0], x=xs[k]: r(x), device, reps)
                        for lin, (_, k) in zip(linears, layer_linears(*shape), strict=True)
                    )
                except RuntimeError as exc:
                    per[run] = {"error": str(exc).splitlines()[0][:200]}
                    continue
                bf16_ms = ms if run == "bf16" else per["bf16"]["ms"]  # bf16 runs first
                weight_bytes = sum(lin[run][1] for lin in linears)
                gb_s = weight_bytes / (ms / 1e3) / 1e9
                per[run] = {
                    "ms": _sig(ms),
                    "weight_gb_s": _sig(gb_s),
                    "fraction_of_copy": _sig(gb_s / report["copy_bandwidth_gb_s"]),
                    "speedup_vs_bf16": _sig(bf16_ms / ms),
                }
            rows_out[str(m)] = per
        report[name] = rows_out
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)
    return report


if __name__ == "__main__":
    main()
