#!/usr/bin/env python3
"""Inter-token latency of decoding requests while long prompts arrive, with and without chunked context.

    python benchmarks/chunked_context.py --model-config configs/models/bench-llama-15m.json

A timed workload: ``--decoders`` short-prompt requests with long outputs start at t=0; ``--long``
long prompts arrive every ``--gap`` seconds while they decode. Without chunking every long prompt runs
whole in one iteration (``max_num_tokens`` must hold it), stalling every decoder for that iteration;
with chunking the same prompts are split into ``--chunk-budget``-token iterations. Both runs use the
same model, requests and arrival times, in one process. Token times are taken client-side from
streamed responses; ITL is every gap between consecutive tokens of a request, pooled. Prints JSON with
p50/p90/p99 ITL of each run and the ratio of the p99s (chunked / whole).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import threading
import time
from pathlib import Path

import torch

from bm.batch_manager import BatchManager, InferenceRequest
from bm.config import load_config
from bm.runtime import load_model


class TimedStreamingClient:
    """Hands each request over once its arrival time has passed; timestamps every streamed token."""

    def __init__(self, requests: list[tuple[float, InferenceRequest]]) -> None:
        self.pending = sorted(requests, key=lambda r: r[0])
        self.token_times: dict[int, list[float]] = {r.request_id: [] for _, r in requests}
        self.arrival: dict[int, float] = {}
        self.start: float | None = None
        self.done = threading.Event()
        self.num_final = 0

    def get_requests(self, max_new: int) -> list[InferenceRequest]:
        now = time.perf_counter()
        if self.start is None:
            self.start = now
        out = []
        while self.pending and self.pending[0][0] <= now - self.start and (max_new < 0 or len(out) < max_new):
            at, request = self.pending.pop(0)
            self.arrival[request.request_id] = self.start + at
            out.append(request)
        return out

    def send_response(self, request_id: int, tensors: dict, final: bool, error: str) -> None:
        if error:
            raise RuntimeError(f"request {request_id} failed: {error}")
        now = time.perf_counter()
        self.token_times[request_id].extend([now] * tensors["output_ids"].shape[1])
        if final:
            self.num_final += 1
            if self.num_final == len(self.token_times):
                self.done.set()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def run(loaded, config, requests) -> dict:
    client = TimedStreamingClient(requests)
    stats: list[str] = []
    with BatchManager(
        config, client.get_requests, client.send_response, return_stats=stats.append, model=loaded
    ):
        client.done.wait()
    gaps = [b - a for times in client.token_times.values() for a, b in itertools.pairwise(times)]
    long_ttft = [times[0] - client.arrival[rid] for rid, times in client.token_times.items() if rid >= 1000]
    iters = [json.loads(s) for s in stats]
    return {
        "itl_ms": {f"p{q}": round(percentile(gaps, q) * 1e3, 2) for q in (50, 90, 99)}
        | {"mean": round(statistics.fmean(gaps) * 1e3, 2)},
        "long_prompt_ttft_ms_mean": round(statistics.fmean(long_ttft) * 1e3, 1) if long_ttft else None,
        "max_tokens_per_iteration": max(
            s["Total Context Tokens"] + s["Total Generation Tokens"] for s in iters
        ),
        "iterations": len(iters),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-config", default="configs/models/bench-llama-15m.json")
    p.add_argument(
        "-c", "--config", type=Path, default=Path(__file__).parent.parent / "configs" / "bench.yaml"
    )
    p.add_argument("--decoders", type=int, default=16)
    p.add_argument("--decode-len", type=int, default=200)
    p.add_argument("--long", type=int, default=6)
    p.add_argument("--long-len", type=int, default=1536)
    p.add_argument("--gap", type=float, default=0.8, help="seconds between long prompts")
    p.add_argument("--chunk-budget", type=int, default=256, help="max_num_tokens with chunked context")
    args = p.parse_args()

    g = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(3, 8000, (n,), generator=g).tolist()

    decoders = [(0.0, i, ids(64), args.decode_len) for i in range(args.decoders)]
    longs = [(0.2 + k * args.gap, 1000 + k, ids(args.long_len), 16) for k in range(args.long)]
    workload = decoders + longs

    def requests():
        return [(at, InferenceRequest.from_values(rid, p, n, streaming=True)) for at, rid, p, n in workload]

    base = {"model.config": args.model_config, "model.path": None}
    whole = load_config(args.config, {**base, "engine.max_num_tokens": max(2048, args.long_len)})
    chunked = load_config(
        args.config,
        {**base, "engine.enable_chunked_context": True, "engine.max_num_tokens": args.chunk_budget},
    )
    loaded = load_model(whole.model)
    run(loaded, whole, requests()[: args.decoders + 1][-2:])  # warm-up: a decoder and a long prompt
    report = {"workload": {k: v for k, v in vars(args).items() if k not in ("config", "model_config")}}
    report["whole_context"] = run(loaded, whole, requests())
    report["chunked_context"] = run(loaded, chunked, requests())
    report["p99_itl_chunked/whole"] = round(
        report["chunked_context"]["itl_ms"]["p99"] / report["whole_context"]["itl_ms"]["p99"], 3
    )
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
