#!/usr/bin/env python3
"""Small-batch GEMMs of a model's shapes: torch's default path against oneDNN with the weight prepacked.

    python benchmarks/small_gemm.py --model-config CFG.json [--rows 1,2,4,8,16,32,64,128,256,512]

Decode iterations multiply a few rows by every weight matrix; this measures, for each distinct linear
shape of the model (and its vocabulary projection), the best-of-N time of ``F.linear`` and of the packed
path bm uses (``bm.runtime.prepack``), interleaved in the same run, and prints the speed-ups as JSON. It
is the measurement behind ``MAX_PACKED_ROWS``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from transformers import AutoConfig

from bm.runtime.prepack import _PACK_HINT


def best_time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-config", required=True)
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,512")
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
    result: dict = {"torch_threads": torch.get_num_threads(), "pack_hint": _PACK_HINT, "speedup": {}}
    for name, (n, k) in shapes.items():
        weight = torch.randn(n, k) * 0.02
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_HINT)
        line = {}
        for m in rows:
            x = torch.randn(m, k)
            default = best_time(lambda x=x, w=weight: F.linear(x, w), args.repeats)
            fast = best_time(
                lambda x=x, w=packed: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [None], ""),
                args.repeats,
            )
            line[m] = round(default / fast, 2)
        result["speedup"][f"{name} {n}x{k}"] = line
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
