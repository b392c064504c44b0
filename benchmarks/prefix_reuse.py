#!/usr/bin/env python3
"""Block reuse on a shared-prefix workload: prefill tokens computed, TTFT and throughput, reuse off vs on.

    python benchmarks/prefix_reuse.py --model-config configs/models/bench-llama-15m.json

The workload: ``--groups`` system prompts of ``--prefix-len`` tokens, each shared by ``--per-group``
requests with their own suffix (``--suffix-min``..``--suffix-max`` tokens) and ``--output-len`` output
tokens, like many users of a few assistants. Requests are shuffled (a seeded order, so groups
interleave) and all submitted at t=0. Both runs use the same model, requests and order, in one process:
first with ``kv_cache.enable_block_reuse: false``, then ``true``. TTFT is taken client-side from the
streamed first token, from submission. Prints JSON: per run, the context (prefill) tokens computed
(the "Total Context Tokens" of every iteration), reused/missed blocks and hit rate, TTFT mean/p50/p99,
output throughput and wall time; then the off/on ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import torch

from bm.batch_manager import BatchManager, InferenceRequest
from bm.config import load_config
from bm.runtime import load_model


class FirstTokenClient:
    """All requests at t=0; records when each request's first token and its final response arrive."""

    def __init__(self, requests: list[InferenceRequest]) -> None:
        self.pending = list(requests)
        self.first_token: dict[int, float] = {}
        self.generated: dict[int, int] = {}
        self.errors: list[str] = []
        self.done = threading.Event()
        self.start = time.perf_counter()
        self.end = self.start
        self.expected = len(requests)
        self.num_final = 0

    def get_requests(self, max_new: int) -> list[InferenceRequest]:
        count = len(self.pending) if max_new < 0 else min(max_new, len(self.pending))
        out, self.pending = self.pending[:count], self.pending[count:]
        return out

    def send_response(self, request_id: int, tensors: dict, final: bool, error: str) -> None:
        now = time.perf_counter()
        if error:
            self.errors.append(f"request {request_id}: {error}")
        n = int(tensors["output_ids"].shape[1])
        if n and request_id not in self.first_token:
            self.first_token[request_id] = now
        self.generated[request_id] = self.generated.get(request_id, 0) + n
        if final:
            self.num_final += 1
            if self.num_final == self.expected:
                self.end = now
                self.done.set()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def build_workload(args: argparse.Namespace) -> list[tuple[list[int], int]]:
    g = torch.Generator().manual_seed(args.seed)

    def ids(n: int) -> list[int]:
        return torch.randint(3, 8000, (n,), generator=g).tolist()

    workload = []
    for _ in range(args.groups):
        prefix = ids(args.prefix_len)
        for _ in range(args.per_group):
            n = int(torch.randint(args.suffix_min, args.suffix_max + 1, (1,), generator=g))
            workload.append((prefix + ids(n), args.output_len))
    order = torch.randperm(len(workload), generator=g).tolist()
    return [workload[i] for i in order]


def run(loaded, config, workload) -> dict:
    requests = [InferenceRequest.from_values(i, p, n, streaming=True) for i, (p, n) in enumerate(workload)]
    client = FirstTokenClient(requests)
    stats: list[str] = []
    client.start = time.perf_counter()
    with BatchManager(
        config, client.get_requests, client.send_response, return_stats=stats.append, model=loaded
    ):
        client.done.wait()
    if client.errors:
        raise SystemExit(f"{len(client.errors)} requests failed, e.g. {client.errors[0]}")
    iters = [json.loads(s) for s in stats]
    ttft = [t - client.start for t in client.first_token.values()]
    elapsed = client.end - client.start
    reused = sum(s["Reused Blocks"] for s in iters)
    missed = sum(s["Missed Blocks"] for s in iters)
    return {
        "prefill_tokens_computed": sum(s["Total Context Tokens"] for s in iters),
        "reused_blocks": reused,
        "missed_blocks": missed,
        "cache_hit_rate": round(reused / (reused + missed), 4) if reused + missed else 0.0,
        "ttft_ms": {
            "mean": round(statistics.fmean(ttft) * 1e3, 1),
            "p50": round(percentile(ttft, 50) * 1e3, 1),
            "p99": round(percentile(ttft, 99) * 1e3, 1),
        },
        "output_throughput_tok_s": round(sum(client.generated.values()) / elapsed, 1),
        "wall_s": round(elapsed, 3),
        "iterations": len(iters),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-config", default="configs/models/bench-llama-15m.json")
    p.add_argument(
        "-c", "--config", type=Path, default=Path(__file__).parent.parent / "configs" / "bench.yaml"
    )
    p.add_argument("--groups", type=int, default=6)
    p.add_argument("--per-group", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=768)
    p.add_argument("--suffix-min", type=int, default=16)
    p.add_argument("--suffix-max", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-num-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    workload = build_workload(args)
    base = {
        "model.config": args.model_config,
        "model.path": None,
        "engine.max_num_tokens": args.max_num_tokens,
        "kv_cache.max_tokens": 65536,
    }
    off = load_config(args.config, {**base, "kv_cache.enable_block_reuse": False})
    on = load_config(args.config, {**base, "kv_cache.enable_block_reuse": True})
    loaded = load_model(off.model)
    run(loaded, off, workload[:2])  # warm-up
    report: dict = {"workload": {k: v for k, v in vars(args).items() if k not in ("config", "model_config")}}
    report["reuse_off"] = run(loaded, off, workload)
    report["reuse_on"] = run(loaded, on, workload)
    a, b = report["reuse_off"], report["reuse_on"]
    report["ratios_off/on"] = {
        "prefill_tokens_computed": round(a["prefill_tokens_computed"] / b["prefill_tokens_computed"], 2),
        "ttft_mean": round(a["ttft_ms"]["mean"] / b["ttft_ms"]["mean"], 2),
        "ttft_p50": round(a["ttft_ms"]["p50"] / b["ttft_ms"]["p50"], 2),
        "ttft_p99": round(a["ttft_ms"]["p99"] / b["ttft_ms"]["p99"], 2),
        "wall": round(a["wall_s"] / b["wall_s"], 2),
    }
    # The least any engine must compute: each shared prefix once, and every request's own suffix.
    ideal = args.groups * args.prefix_len + sum(len(prompt) - args.prefix_len for prompt, _ in workload)
    report["ideal_prefill_tokens"] = ideal
    report["reuse_on_prefill_over_ideal"] = round(b["prefill_tokens_computed"] / ideal, 3)
    report["output_throughput_on/off"] = round(b["output_throughput_tok_s"] / a["output_throughput_tok_s"], 2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
