#!/usr/bin/env python3
"""A cache-bound run with a quantized KV cache against the float32 one, in the same bytes of memory.

    python benchmarks/kv_quant_speed.py [--dtype int8|fp8_e4m3] [--model-config configs/models/bench-llama-15m.json]
        [--requests 32] [--prompt-len 128] [--output-len 256] [--fp32-tokens 1024] [--rounds 3]

Every request is submitted at t=0, end tokens never sampled (each runs to its full length), with
``engine.scheduler_policy: max_utilization``. The float32 cache holds ``--fp32-tokens`` tokens; the
quantized cache gets the same bytes, so it holds as many more tokens as its rows are smaller (at head
size 64: int8's 68 bytes a row instead of 256, 3.8x; fp8's 64, 4x), and more requests run at once. The
two alternate, ``--rounds`` each, in one process over one loaded model. Prints JSON: output tok/s of
every run, the cache's tokens and each run's largest batch, and the median quantized / float32 ratio.
Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from common import log, run_bm

from bm.config import config_from_dict
from bm.config.model import ModelConfig
from bm.runtime.model_loader import load_model

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 32


def run(loaded, kv_dtype: str, max_tokens: int, workload) -> dict:
    config = config_from_dict(
        {
            "model": {"device": "cpu"},
            "engine": {"scheduler_policy": "max_utilization", "max_batch_size": len(workload)},
            "kv_cache": {"dtype": kv_dtype, "max_tokens": max_tokens, "tokens_per_block": BLOCK},
        }
    )
    result, stats = run_bm(loaded, config, workload)  # no end token: every request runs its full length
    return {
        "kv_cache_dtype": kv_dtype,
        "cache_tokens": max_tokens,
        "output_tok_s": round(result.output_tok_s, 1),
        "most_active_requests": max((s.get("Active Request Count", 0) for s in stats), default=0),
        "wall_s": round(result.wall_s, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", choices=("int8", "fp8_e4m3"), default="int8")
    p.add_argument("--model-config", type=Path, default=ROOT / "configs/models/bench-llama-15m.json")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--fp32-tokens", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    loaded = load_model(ModelConfig(config=str(args.model_config), device="cpu"))
    g = torch.Generator().manual_seed(0)
    workload = [
        (torch.randint(3, loaded.vocab_size, (args.prompt_len,), generator=g).tolist(), args.output_len)
        for _ in range(args.requests)
    ]
    quantized = args.dtype
    full, small = loaded.kv_cache_bytes_per_token("auto"), loaded.kv_cache_bytes_per_token(quantized)
    small_tokens = args.fp32_tokens * full // small // BLOCK * BLOCK  # the same bytes
    runs: dict[str, list[dict]] = {"auto": [], quantized: []}
    for r in range(args.rounds):
        for dtype in ("auto", quantized) if r % 2 == 0 else (quantized, "auto"):
            result = run(loaded, dtype, args.fp32_tokens if dtype == "auto" else small_tokens, workload)
            log(json.dumps(result))
            runs[dtype].append(result)
    ratios = [
        q["output_tok_s"] / a["output_tok_s"] for a, q in zip(runs["auto"], runs[quantized], strict=True)
    ]
    print(
        json.dumps(
            {
                "model_config": str(args.model_config),
                "workload": {
                    "requests": args.requests,
                    "prompt_len": args.prompt_len,
                    "output_len": args.output_len,
                },
                "cache_bytes": args.fp32_tokens * full,
                "kv_bytes_per_token": {"float32": full, quantized: small},
                "runs": runs,
                f"{quantized}_over_float32_per_round": [round(x, 3) for x in ratios],
                "median_ratio": round(statistics.median(ratios), 3),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
