#!/usr/bin/env python3
"""A model's GEMM shapes: torch's default path against the two packed paths of ``bm.runtime.prepack``.

    python benchmarks/small_gemm.py --model-config CFG.json [--rows 1,2,4,8,16,32,64,128,256,512,2048]

For each distinct linear shape of the model (and its vocabulary projection) and each row count, the
best-of-N time of ``F.linear`` (MKL), of oneDNN with the weight prepacked, and of bm's compiled panel GEMM
(``native/small_gemm.c``), interleaved in the same run. Prints JSON: GFLOP/s of each path, and the speed-up
of each packed path over ``F.linear``. The weight stays in cache between repeats here, so the small-row
figures are above what a forward streaming every weight from memory gets.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from roofline import best_time
from transformers import AutoConfig

from bm.runtime.native import SmallGemmKernel, small_gemm_kernel
from bm.runtime.prepack import _PACK_HINT


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-config", required=True)
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,512,2048")
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    cfg = AutoConfig.from_pretrained(args.model_config)
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    head_dim = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
    q = cfg.num_attention_heads * head_dim
    kv = (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * head_dim
    shapes = {"q": (q, hidden), "k/v": (kv, hidden), "o": (hidden, q), "gate/up": (inter, hidden),
              "down": (hidden, inter), "lm_head": (cfg.vocab_size, hidden)}  # fmt: skip
    rows = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    kernel = small_gemm_kernel()
    result: dict = {"torch_threads": torch.get_num_threads(), "pack_hint": _PACK_HINT, "shapes": {}}
    result["native_kernel"] = kernel is not None
    for name, (n, k) in shapes.items():
        weight = torch.randn(n, k) * 0.02
        onednn = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_HINT)
        panels = SmallGemmKernel.pack(weight) if kernel else None
        line = {}
        for m in rows:
            x = torch.randn(m, k)
            flop = 2 * m * n * k / 1e9
            times = {
                "torch": best_time(lambda x=x, w=weight: F.linear(x, w), args.repeats),
                "onednn_packed": best_time(
                    lambda x=x, w=onednn: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [None], ""),
                    args.repeats,
                ),
            }
            if kernel:
                times["bm_panel"] = best_time(lambda x=x, w=panels, n=n: kernel(x, w, None, n), args.repeats)
            line[m] = {
                **{f"{path}_gflop_s": round(flop / t, 1) for path, t in times.items()},
                **{
                    f"{path}_speedup": round(times["torch"] / t, 2)
                    for path, t in times.items()
                    if path != "torch"
                },
            }
        result["shapes"][f"{name} {n}x{k}"] = line
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
