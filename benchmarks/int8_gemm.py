#!/usr/bin/env python3
"""bm's int8-weight GEMM against the other ways to run a linear on this CPU, on a model's shapes.

    python benchmarks/int8_gemm.py [--rows 1,8,64,256] [--threads 1] [--reps 5]
        [--shapes 2048x2048,8192x2048,2048x8192]

Per row count M, the best of ``--reps`` calls of each, summed over the shapes (N x K; default a
Llama-3.2-1B layer's q/o, gate/up and down): bm's float32 panel GEMM (what a float32 layer runs), oneDNN
in bf16 (a bf16 layer's ``auto`` on AMX machines), torch's int8 weight-only GEMM
(``torch._weight_int8pack_mm``) with float32 and bf16 activations, torchao's ``Int8WeightOnlyConfig``
where torchao imports, and bm's int8 GEMM. Prints JSON: milliseconds and each one's speed relative to
bm's float32 GEMM.
"""

from __future__ import annotations

import argparse
import json

import torch
from roofline import best_time

from bm.runtime.native import int8_gemm_kernel, small_gemm_kernel


def torchao_linear(weight: torch.Tensor, dtype: torch.dtype):
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError:
        return None
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False).to(dtype)
    linear.weight.data = weight.to(dtype)
    quantize_(linear, Int8WeightOnlyConfig())
    return linear


def timings(layer: dict, m: int, reps: int) -> dict[str, float]:
    """Milliseconds of each way to run one layer's product over ``m`` rows."""
    int8, fp32, n = layer["int8"], layer["fp32"], layer["n"]
    x = torch.randn(m, layer["k"])
    xb = x.bfloat16()
    runs = {
        "bm_fp32": lambda: fp32(x, layer["fp32_packed"], None, n),
        "onednn_bf16": lambda: torch.nn.functional.linear(xb, layer["wb"]),
        "torch_int8pack_fp32_act": lambda: torch._weight_int8pack_mm(x, layer["q"], layer["scale"]),
        "torch_int8pack_bf16_act": lambda: torch._weight_int8pack_mm(
            xb, layer["q"], layer["scale"].bfloat16()
        ),
        "bm_int8": lambda: int8(x, layer["packed"], layer["scale"], None),
    }
    if layer["ao32"] is not None:
        runs["torchao_int8_fp32_act"] = lambda: layer["ao32"](x)
        runs["torchao_int8_bf16_act"] = lambda: layer["ao16"](xb)
    return {name: 1e3 * best_time(fn, reps) for name, fn in runs.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,8,64,256")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--shapes", default="2048x2048,8192x2048,2048x8192")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    int8, fp32 = int8_gemm_kernel(), small_gemm_kernel()
    layers = []
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        w = torch.randn(n, k)
        scale = w.abs().amax(1) / 127
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        layers.append(
            {"n": n, "k": k, "int8": int8, "fp32": fp32, "q": q, "scale": scale, "packed": int8.pack(q),
             "fp32_packed": fp32.pack(w), "wb": w.bfloat16(), "ao32": torchao_linear(w, torch.float32),
             "ao16": torchao_linear(w, torch.bfloat16)}
        )  # fmt: skip
    report = {"threads": args.threads, "shapes": args.shapes, "int8_isa": int8.isa, "rows": {}}
    with torch.inference_mode():
        for m in (int(r) for r in args.rows.split(",")):
            ms: dict[str, float] = {}
            for layer in layers:
                for name, value in timings(layer, m, args.reps).items():
                    ms[name] = ms.get(name, 0.0) + value
            report["rows"][m] = {
                name: {"ms": round(v, 2), "vs_bm_fp32": round(ms["bm_fp32"] / v, 2)} for name, v in ms.items()
            }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
