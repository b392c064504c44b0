#!/usr/bin/env python3
"""Each C kernel's builds (AVX-512, AVX2, scalar: bm.cpu_isa) against each other, in one sitting.

    python benchmarks/cpu_isa.py [--repeats 20] [--isas avx512,avx2]

Shapes are SmolLM2-135M's (hidden 576, MLP 1536, 9 query heads over 3 kv heads of 64): the panel GEMM at
decode and prefill row counts, decode attention over 32 rows of 300-token contexts, prefill attention of
a 512-token prompt, the elementwise chains at 256 rows, the LoRA delta (rank 8) at 64 rows. The builds
are timed alternately (one call of each in turn, ``--repeats`` rounds, the best kept), so a shared
machine's load falls on all of them alike (``--threads 1`` keeps a busy shared machine's descheduled
OpenMP workers out of the figures). Prints JSON: microseconds per call of each build, GFLOP/s
where the FLOP count is plain, and each build's speed-up over the AVX2 one.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable

import torch

from bm.cpu_isa import cpu_features, machine_isas
from bm.runtime import native
from bm.runtime.native import LoraDeltaWeights, SmallGemmKernel

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 9, 3, 64


def alternate(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Best seconds per call of each entry, timed in turns after one warm-up call each."""
    for fn in calls.values():
        fn()
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(repeats):
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def gemm_cases(isas: list[str]) -> dict[str, tuple[dict[str, Callable[[], object]], float]]:
    cases = {}
    for rows in (1, 8, 64, 512):
        for name, (n, k) in {"qkv": (HIDDEN + 2 * 192, HIDDEN), "gate_up": (2 * INTER, HIDDEN),
                             "down": (HIDDEN, INTER)}.items():  # fmt: skip
            weight = torch.randn(n, k) * 0.02
            packed = SmallGemmKernel.pack(weight)
            x = torch.randn(rows, k)
            kernels = {isa: native.small_gemm_kernel(isa) for isa in isas}
            calls = {
                isa: (lambda kr=kr, x=x, p=packed, n=n: kr(x, p, None, n))
                for isa, kr in kernels.items()
                if kr
            }
            cases[f"small_gemm {name} {rows}x{k}->{n}"] = (calls, 2 * rows * n * k)
    return cases


def attention_cases(isas: list[str]) -> dict[str, tuple[dict[str, Callable[[], object]], float]]:
    cases = {}
    rows, ctx, bs = 32, 300, 16
    blocks = rows * -(-ctx // bs)
    cache = torch.randn(2, KV_HEADS, blocks, bs, HEAD_DIM)
    table = torch.arange(blocks).view(rows, -1)
    q = torch.randn(rows, HEADS, HEAD_DIM).transpose(0, 1)
    out = torch.empty(rows, HEADS, HEAD_DIM)
    idx, lengths = torch.arange(rows), torch.full((rows,), ctx)
    calls = {}
    for isa in isas:
        kr = native.paged_decode_kernel(isa)
        calls[isa] = lambda kr=kr: kr(out, q, cache, native.DecodeRows(idx, table, lengths, ctx), 0.125)
    cases[f"paged_decode {rows} rows x {ctx} keys"] = (calls, 4 * rows * ctx * HEADS * HEAD_DIM)
    tokens = 512
    qp = torch.randn(tokens, HEADS, HEAD_DIM).transpose(0, 1)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM).transpose(0, 1)
    v = torch.randn(tokens, KV_HEADS, HEAD_DIM).transpose(0, 1)
    outp = torch.empty(tokens, HEADS, HEAD_DIM)
    calls = {}
    for isa in isas:
        kr = native.prefill_attention_kernel(isa)
        calls[isa] = lambda kr=kr: kr(outp, qp, k, v, 0, tokens, 0.125)
    cases[f"prefill_attention {tokens} tokens"] = (calls, 2 * tokens * tokens * HEADS * HEAD_DIM)
    return cases


def elementwise_cases(isas: list[str]) -> dict[str, tuple[dict[str, Callable[[], object]], float]]:
    rows = 256
    x, w = torch.randn(rows, HIDDEN), torch.randn(HIDDEN)
    gate, up = torch.randn(rows, INTER), torch.randn(rows, INTER)
    qr, cos, sin = (
        torch.randn(rows, HEADS, HEAD_DIM),
        torch.randn(rows, HEAD_DIM),
        torch.randn(rows, HEAD_DIM),
    )
    a, b = torch.randn(4, 8, HIDDEN) * 0.05, torch.randn(4, 8, HIDDEN)
    lora = LoraDeltaWeights(a, b, torch.full((4,), 8, dtype=torch.int64))
    lx, ly = torch.randn(64, HIDDEN), torch.randn(64, HIDDEN)
    slots = torch.arange(64) // 16
    cases: dict[str, tuple[dict[str, Callable[[], object]], float]] = {}
    ew = {isa: native.elementwise_kernels(isa) for isa in isas}
    cases[f"rms_norm {rows}x{HIDDEN}"] = ({i: (lambda e=e: e.rms_norm(x, w, 1e-5)) for i, e in ew.items()}, 0)
    cases[f"silu_mul {rows}x{INTER}"] = ({i: (lambda e=e: e.silu_mul(gate, up)) for i, e in ew.items()}, 0)
    cases[f"rotary {rows}x{HEADS}x{HEAD_DIM}"] = (
        {i: (lambda e=e: e.rotary(qr, cos, sin)) for i, e in ew.items()},
        0,
    )
    lk = {isa: native.lora_delta_kernel(isa) for isa in isas}
    cases["lora_delta 64 rows rank 8"] = (
        {i: (lambda kr=kr: kr(lx, ly, 0, slots, lora)) for i, kr in lk.items()},
        0,
    )
    return cases


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=None, help="torch (and kernel) threads; default torch's")
    p.add_argument("--isas", default=None, help="comma-separated builds (default: every one this CPU runs)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    isas = args.isas.split(",") if args.isas else [i for i in machine_isas() if i != "scalar"]
    torch.manual_seed(0)
    features = sorted(f for f in cpu_features() if f.startswith(("avx", "fma", "amx")))
    result: dict = {"machine": platform.machine(), "cpu_features": features,
                    "torch_threads": torch.get_num_threads(), "isas": isas, "kernels": {}}  # fmt: skip
    for name, (calls, flop) in {
        **gemm_cases(isas),
        **attention_cases(isas),
        **elementwise_cases(isas),
    }.items():
        best = alternate(calls, args.repeats)
        line: dict = {}
        for isa, seconds in best.items():
            line[f"{isa}_us"] = round(seconds * 1e6, 1)
            if flop:
                line[f"{isa}_gflops"] = round(flop / seconds / 1e9, 1)
        if "avx2" in best:
            for isa in best:
                if isa != "avx2":
                    line[f"{isa}_speedup_over_avx2"] = round(best["avx2"] / best[isa], 2)
        result["kernels"][name] = line
        print(name, line, flush=True, file=__import__("sys").stderr)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
