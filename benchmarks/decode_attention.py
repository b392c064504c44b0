#!/usr/bin/env python3
"""Decode attention alone: the compiled paged kernel against the torch gather-then-SDPA path.

    python benchmarks/decode_attention.py --model-config configs/models/bench-llama-15m.json

Builds one layer's KV cache for the model's shapes, places ``--rows`` decoding requests with context
lengths uniform in ``--min-len``..``--max-len`` on shuffled blocks (a pool after some churn), and times
both paths on the same metadata the engine builds (the torch backend's decode groups and its native
rows), interleaved, ``--repeat`` times each. Prints JSON: per path the median milliseconds per layer
call and the effective key/value bandwidth, the speed-up, and the largest difference between the two
outputs. The whole-engine effect is measured by ``benchmarks/throughput.py`` with
``BM_NATIVE_KERNELS=0`` and ``1``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bm.kv import cdiv
from bm.runtime import ModelRunner, load_model
from bm.runtime.backends.torch_ops import decode
from bm.runtime.model_loader import ModelConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-config", required=True, help="model config JSON (random weights)")
    p.add_argument("--rows", type=int, default=128, help="decoding requests in the batch")
    p.add_argument("--min-len", type=int, default=200)
    p.add_argument("--max-len", type=int, default=1100)
    p.add_argument("--tokens-per-block", type=int, default=32)
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if not 1 <= args.min_len <= args.max_len:
        p.error("--min-len and --max-len: need 1 <= min-len <= max-len")

    loaded = load_model(ModelConfig(config=args.model_config, device="cpu", seed=args.seed))
    rng = random.Random(args.seed)
    bs = args.tokens_per_block
    lengths = [rng.randint(args.min_len, args.max_len) for _ in range(args.rows)]
    num_blocks = sum(cdiv(n, bs) for n in lengths) + 64
    runner = ModelRunner(loaded, num_blocks=num_blocks, tokens_per_block=bs, max_seq_len=args.max_len)
    backend = runner.backend
    kernel = getattr(backend, "native_decode", None)
    if kernel is None:
        print(
            json.dumps({"error": "the native kernel is not available here (no C compiler, or switched off)"})
        )
        sys.exit(1)
    free = list(range(num_blocks))
    rng.shuffle(free)
    rows = []
    for i, n in enumerate(lengths):
        rows.append((i, n, [free.pop() for _ in range(cdiv(n, bs))]))

    layer = min(loaded.kv_shapes)
    cache = runner.kv_caches[layer]
    with torch.inference_mode():
        cache.normal_()
    heads = loaded.model.config.num_attention_heads
    head_dim = cache.shape[-1]
    q = torch.randn(args.rows, heads, head_dim).transpose(
        0, 1
    )  # [heads, T, d], as transformers hands it over
    scaling = head_dim**-0.5
    layout = backend.layouts[runner.window]
    groups = layout.decode_groups(rows)
    native = layout.native_decode_rows(rows)
    out_torch = torch.empty(args.rows, heads, head_dim)
    out_native = torch.empty(args.rows, heads, head_dim)

    def torch_path() -> None:
        for group in groups:
            decode(out_torch, q, cache, group, scaling, backend.scratch)

    def native_path() -> None:
        kernel(out_native, q, cache, native, scaling)

    times: dict[str, list[float]] = {"torch": [], "native": []}
    with torch.inference_mode():
        torch_path()
        native_path()
        for _ in range(args.repeat):
            for name, fn in (("torch", torch_path), ("native", native_path)):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)

    kv_bytes = sum(lengths) * 2 * cache.shape[1] * head_dim * cache.element_size()
    result: dict[str, object] = {
        "model_config": args.model_config,
        "rows": args.rows,
        "mean_context": statistics.mean(lengths),
        "torch_threads": torch.get_num_threads(),
        "torch_groups": len(groups),
    }
    for name, samples in times.items():
        med = statistics.median(samples)
        result[name] = {"median_ms": round(med * 1e3, 3), "kv_gb_per_s": round(kv_bytes / med / 1e9, 2)}
    result["speedup"] = round(result["torch"]["median_ms"] / result["native"]["median_ms"], 2)
    result["max_abs_diff"] = (out_torch - out_native).abs().max().item()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
