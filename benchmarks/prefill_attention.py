#!/usr/bin/env python3
"""Prefill attention of one prompt: torch's SDPA (bm's fallback path) against bm's compiled kernel.

    python benchmarks/prefill_attention.py [--heads 9 --kv-heads 3 --head-dim 64]
        [--lengths 64,128,256,340,512,768,1024] [--prefix 256:256]

Defaults are SmolLM2-135M's attention shape. For each prompt length, a causal chunk with no cached prefix
the way ``bm.runtime.attention._prefill`` runs it (SDPA with ``is_causal`` on the packed batch's strided
views); for each ``CACHED:NEW`` pair of ``--prefix``, a chunk of NEW tokens after CACHED cached ones,
keys read from a paged cache by block table (SDPA: gather plus boolean mask, as bm does). Best-of-N times,
the two paths interleaved in the same run, next to a 2048^3 ``torch.mm`` peak measured before and after
(the higher counts). FLOPs count only the causal half: 4 * heads * d * (pairs of query and attended key).
Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial

import torch
import torch.nn.functional as F

from bm.runtime.native import prefill_attention_kernel


def best_time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def mm_peak(repeats: int = 5) -> float:
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    return 2 * 2048**3 / best_time(lambda: torch.mm(a, b), repeats) / 1e9


def causal_pairs(cached: int, new: int) -> int:
    """Query-key pairs a chunk of ``new`` tokens after ``cached`` ones attends."""
    return new * cached + new * (new + 1) // 2


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--lengths", default="64,128,256,340,512,768,1024")
    p.add_argument("--prefix", default="256:256,512:128", help="CACHED:NEW pairs, comma-separated")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    heads, kv_heads, d = args.heads, args.kv_heads, args.head_dim
    scale = d**-0.5
    torch.manual_seed(0)
    kernel = prefill_attention_kernel()
    peak_before = mm_peak()
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

    peak = max(peak_before, mm_peak())
    result["mm_peak_gflop_s"] = round(peak, 1)
    for section in ("no_prefix", "cached_prefix"):
        for row in result[section].values():
            for key in [k for k in row if k.endswith("_gflop_s")]:
                row[key.replace("_gflop_s", "_of_peak")] = round(row[key] / peak, 3)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
