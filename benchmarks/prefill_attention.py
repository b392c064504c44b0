#!/usr/bin/env python3
"""Prefill attention of one prompt: torch's SDPA (bm's fallback path) against bm's compiled kernel.

    python benchmarks/prefill_attention.py [--heads 9 --kv-heads 3 --head-dim 64]
        [--lengths 64,128,256,340,512,768,1024] [--prefix 256:256]

Defaults are SmolLM2-135M's attention shape. For each prompt length, a causal chunk with no cached prefix
the way ``bm.runtime.backends.torch_ops.prefill`` runs it (SDPA with ``is_causal`` on the packed batch's strided
views); for each ``CACHED:NEW`` pair of ``--prefix``, a chunk of NEW tokens after CACHED cached ones,
keys read from a paged cache by block table (SDPA: gather plus boolean mask, as bm does). Best-of-N times,
the two paths interleaved in the same run, next to a 2048^3 ``torch.mm`` peak measured before and after
(the higher counts). FLOPs count only the causal half: 4 * heads * d * (pairs of query and attended key).
Prints JSON.

    python benchmarks/prefill_attention.py --engine WORKLOAD.jsonl --model-config CFG.json

instead runs bm on a workload (as ``benchmarks/throughput.py`` does) and computes every prefill segment of
every layer twice, with the kernel and with SDPA, in alternating order, timing each: the two paths on the
engine's real segments, side by side. The figures are per prompt-length bucket and in total.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from common import BENCH_CONFIG, model_overrides, read_workload, run_bm
from roofline import best_time, measure_gemm_peak

from bm.config import load_config
from bm.runtime import load_model
from bm.runtime.backends import torch_backend, torch_ops
from bm.runtime.native import prefill_attention_kernel


def causal_pairs(cached: int, new: int) -> int:
    """Query-key pairs a chunk of ``new`` tokens after ``cached`` ones attends."""
    return new * cached + new * (new + 1) // 2


def in_engine(workload_path: Path, args: argparse.Namespace) -> dict:
    """Every prefill segment of a bm run through both paths, timed per call (see the module docstring)."""
    config = load_config(args.config, model_overrides(args))
    loaded = load_model(config.model)
    workload = read_workload(workload_path)
    native, prefill = torch_ops._native_prefill, torch_backend.prefill
    calls: list[tuple[int, int, float, float]] = []

    def both(out, call, cache, seg) -> None:
        took = {}
        for path in ("kernel", "sdpa") if len(calls) % 2 else ("sdpa", "kernel"):
            torch_ops._native_prefill = native if path == "kernel" else (lambda *_: None)
            start = time.perf_counter()
            prefill(out, call, cache, seg)
            took[path] = time.perf_counter() - start
        torch_ops._native_prefill = native
        calls.append((seg.end - seg.start, seg.prefix_len, took["kernel"], took["sdpa"]))

    torch_backend.prefill = both
    try:
        run_bm(loaded, config, workload)
    finally:
        torch_backend.prefill, torch_ops._native_prefill = prefill, native
    heads, d = q_shape(loaded.model.config)
    buckets: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for length, prefix, kernel_s, sdpa_s in calls:
        low = min(length // 128, 8) * 128
        row = buckets[f"{low}-{low + 127 if low < 1024 else 'longer'}{' after a prefix' if prefix else ''}"]
        row[0] += 1
        row[1] += kernel_s
        row[2] += sdpa_s
        row[3] += 4 * heads * d * causal_pairs(prefix, length) / 1e9
    per_bucket = {
        name: {"calls": n, "kernel_gflop_s": round(f / ks, 1), "sdpa_gflop_s": round(f / ss, 1),
               "speedup": round(ss / ks, 2)}
        for name, (n, ks, ss, f) in sorted(buckets.items(), key=lambda x: int(x[0].split("-")[0]))
    }  # fmt: skip
    kernel_s, sdpa_s = sum(c[2] for c in calls), sum(c[3] for c in calls)
    return {
        "workload": str(workload_path),
        "torch_threads": torch.get_num_threads(),
        "prefill_calls": len(calls),
        "kernel_s": round(kernel_s, 3),
        "sdpa_s": round(sdpa_s, 3),
        "speedup": round(sdpa_s / kernel_s, 2) if kernel_s else None,
        "by_prompt_length": per_bucket,
    }


def q_shape(cfg) -> tuple[int, int]:
    """Query heads and head size of a transformers config."""
    return cfg.num_attention_heads, getattr(
        cfg, "head_dim", None
    ) or cfg.hidden_size // cfg.num_attention_heads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--lengths", default="64,128,256,340,512,768,1024")
    p.add_argument("--prefix", default="256:256,512:128", help="CACHED:NEW pairs, comma-separated")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--engine", type=Path, metavar="WORKLOAD.jsonl", help="time the engine's own segments")
    model = p.add_mutually_exclusive_group()  # as benchmarks/common.py's, needed only with --engine
    model.add_argument("--model-config", help="model config JSON (random weights), with --engine")
    model.add_argument("--model", help="a checkpoint directory, with --engine")
    p.add_argument("-c", "--config", type=Path, default=BENCH_CONFIG, help="bm config file, with --engine")
    p.add_argument("-s", "--set", action="append", default=[], help="bm config override, with --engine")
    args = p.parse_args()
    if args.engine:
        if not (args.model_config or args.model):
            p.error("--engine needs --model-config or --model")
        if prefill_attention_kernel() is None:
            p.error("--engine compares the compiled kernel with SDPA, and this machine has no kernel")
        print(json.dumps(in_engine(args.engine, args), indent=1))
        return
    heads, kv_heads, d = args.heads, args.kv_heads, args.head_dim
    scale = d**-0.5
    torch.manual_seed(0)
    kernel = prefill_attention_kernel()
    peak_before = measure_gemm_peak() / 1e9
    result: dict = {
        "torch_threads": torch.get_num_threads(),
        "shape": {"heads": heads, "kv_heads": kv_heads, "head_dim": d},
        "native_kernel": kernel is not None,
        "no_prefix": {},
        "cached_prefix": {},
    }

    def line(pairs: int, times: dict[str, float]) -> dict:
        gflop = 4 * heads * d * pairs / 1e9
        row = {f"{path}_gflop_s": round(gflop / t, 1) for path, t in times.items()}
        row.update({f"{path}_ms": round(t * 1e3, 3) for path, t in times.items()})
        if "bm_kernel" in times:
            row["speedup"] = round(times["sdpa"] / times["bm_kernel"], 2)
        return row

    for n in [int(x) for x in args.lengths.split(",")]:
        # [tokens, heads, d] buffers seen as [heads, tokens, d], the views transformers hands bm
        q = torch.randn(n, heads, d).transpose(0, 1)
        k = torch.randn(n, kv_heads, d).transpose(0, 1)
        v = torch.randn(n, kv_heads, d).transpose(0, 1)
        out = torch.empty(n, heads, d)

        def sdpa(q=q, k=k, v=v, out=out):
            res = F.scaled_dot_product_attention(
                q[None], k[None], v[None], is_causal=True, scale=scale, enable_gqa=True
            )
            out.copy_(res[0].transpose(0, 1))

        times = {"sdpa": best_time(sdpa, args.repeats)}
        if kernel:
            times["bm_kernel"] = best_time(partial(kernel, out, q, k, v, 0, n, scale), args.repeats)
        result["no_prefix"][n] = line(causal_pairs(0, n), times)

    bs = args.block_size
    for pair in args.prefix.split(",") if args.prefix else []:
        cached, new = (int(x) for x in pair.split(":"))
        ctx = cached + new
        nblocks = -(-ctx // bs)
        cache = torch.randn(2, kv_heads, 4 * nblocks, bs, d)
        table = torch.randperm(4 * nblocks)[:nblocks]
        q = torch.randn(new, heads, d).transpose(0, 1)
        k = torch.randn(new, kv_heads, d).transpose(0, 1)
        v = torch.randn(new, kv_heads, d).transpose(0, 1)
        mask = torch.arange(ctx)[None, :] <= torch.arange(cached, ctx)[:, None]
        out = torch.empty(new, heads, d)

        def sdpa_paged(q=q, cache=cache, table=table, mask=mask, out=out, ctx=ctx):
            kv = cache.index_select(2, table).view(2, kv_heads, -1, d)[:, :, :ctx]
            res = F.scaled_dot_product_attention(
                q[None], kv[0][None], kv[1][None], attn_mask=mask, scale=scale, enable_gqa=True
            )
            out.copy_(res[0].transpose(0, 1))

        times = {"sdpa": best_time(sdpa_paged, args.repeats)}
        if kernel:
            run = partial(kernel, out, q, k, v, 0, new, scale, cache, table, cached)
            times["bm_kernel"] = best_time(run, args.repeats)
        result["cached_prefix"][pair] = line(causal_pairs(cached, new), times)

    peak = max(peak_before, measure_gemm_peak() / 1e9)
    result["mm_peak_gflop_s"] = round(peak, 1)
    for section in ("no_prefix", "cached_prefix"):
        for row in result[section].values():
            for key in [k for k in row if k.endswith("_gflop_s")]:
                row[key.replace("_gflop_s", "_of_peak")] = round(row[key] / peak, 3)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
