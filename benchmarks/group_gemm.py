#!/usr/bin/env python3
"""bm's group GEMM (a GGUF file's Q4_1 and Q8_0 blocks, GPTQ and AWQ int4: ``group_gemm.c``) against bm's
float32 panel GEMM over the same weights expanded, bm's int8-weight GEMM, and torch's own int4 CPU GEMM
(``torch._weight_int4pack_mm_for_cpu``, what torchao's int4 CPU layout calls), on a model's shapes.

    python benchmarks/group_gemm.py [--rows 1,8,64,256] [--threads 2] [--reps 7]
        [--shapes 576x576,192x576,1536x576,576x1536]

Per row count M, the best of ``--reps`` calls of each, summed over the shapes (N x K; default
SmolLM2-135M's q/o, k/v, gate/up and down). The weights are random blocks; the float32 GEMM runs their
exact expansion, so the two compute the same bits and only the time differs (torch's int4 GEMM rounds
its own way: timed, not compared). Prints JSON: microseconds per layer set and each one's speed as a
multiple of bm's float32 GEMM.
"""

from __future__ import annotations

import argparse
import json

import torch
from roofline import best_time

from bm.runtime.native import GroupWeight, group_gemm_kernel, int8_gemm_kernel, small_gemm_kernel


def layer_runs(layer: dict, x: torch.Tensor, group, fp32, int8) -> dict:
    """Each way to run one layer's product over ``x``, as a call."""
    scale = torch.ones(layer["n"])
    xb, szb = x.bfloat16(), layer["torch_int4_sz"].bfloat16()
    return {
        "bm_fp32": lambda: fp32(x, layer["fp32"], None, layer["n"]),
        "bm_q4_1": lambda: group(x, layer["q4_1"], None),
        "bm_q8_0": lambda: group(x, layer["q8_0"], None),
        "bm_int8": lambda: int8(x, layer["int8"], scale, None),
        "torch_int4_fp32_act": lambda: torch._weight_int4pack_mm_for_cpu(
            x, layer["torch_int4"], 32, layer["torch_int4_sz"]
        ),
        "torch_int4_bf16_act": lambda: torch._weight_int4pack_mm_for_cpu(xb, layer["torch_int4"], 32, szb),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,8,64,256")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--shapes", default="576x576,192x576,1536x576,576x1536")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    group, fp32, int8 = group_gemm_kernel(), small_gemm_kernel(), int8_gemm_kernel()
    if group is None or fp32 is None or int8 is None:
        raise SystemExit("bm's C kernels do not build here")
    layers = []
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        d = torch.rand(n, k // 32, generator=g) / 50
        q4_1 = GroupWeight.pack(
            torch.randint(0, 16, (n, k), generator=g), d, torch.randn(n, k // 32, generator=g) / 10, 4, 32
        )
        q8_0 = GroupWeight.pack(torch.randint(-128, 128, (n, k), generator=g), d, torch.zeros_like(d), 8, 32)
        q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        u = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
        layers.append(
            {"n": n, "k": k, "q4_1": q4_1, "q8_0": q8_0, "fp32": fp32.pack(q4_1.expanded()), "int8": int8.pack(q),
             "torch_int4": torch._convert_weight_to_int4pack_for_cpu(u, 2),
             "torch_int4_sz": torch.stack((d.T, torch.randn(k // 32, n, generator=g) / 10), -1).contiguous()}
        )  # fmt: skip
    report: dict = {"threads": args.threads, "shapes": args.shapes, "isa": group.isa, "rows": {}}
    for m in (int(v) for v in args.rows.split(",")):
        names = ("bm_fp32", "bm_q4_1", "bm_q8_0", "bm_int8", "torch_int4_fp32_act", "torch_int4_bf16_act")
        total = dict.fromkeys(names, 0.0)
        reps = args.reps * (4 if m <= 8 else 1)
        for layer in layers:
            runs = layer_runs(layer, torch.randn(m, layer["k"], generator=g), group, fp32, int8)
            for name, fn in runs.items():
                total[name] += best_time(fn, reps)
        row = {name: round(1e6 * t, 1) for name, t in total.items()}
        for name in names[1:]:
            row[f"{name}_speed_vs_fp32"] = round(total["bm_fp32"] / total[name], 2)
        report["rows"][m] = row
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
