#!/usr/bin/env python3
"""Where bm's engine time goes on one workload: torch profiler operator totals, as JSON.

    python benchmarks/profile_engine.py WORKLOAD.jsonl (--model-config CFG.json | --model DIR)
        [--limit N] [-s SECTION.KEY=VALUE ...] [--top 25]

Warms up on two requests, then runs the first ``--limit`` (all at t=0, end tokens ignored) under
``torch.profiler`` and prints the operators that took the most self CPU time, with their share of the
profiled wall time. Time not covered by any operator is Python (engine, scheduler, model glue). Used to
decide what to optimise next; see docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from common import add_model_arguments, log, model_overrides, read_workload, run_bm
from torch.profiler import ProfilerActivity, profile

from bm.config import load_config
from bm.engine import EngineCore, Request
from bm.runtime import load_model
from bm.runtime.executor import TorchExecutor


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("workload", type=Path)
    add_model_arguments(p)
    p.add_argument("--limit", type=int, default=32, help="first N requests only")
    p.add_argument("--top", type=int, default=25, help="operators to list")
    args = p.parse_args()

    config = load_config(args.config, model_overrides(args))
    workload = read_workload(args.workload, args.limit)
    torch.manual_seed(0)
    loaded = load_model(config.model)
    log("warm-up on 2 requests")
    run_bm(loaded, config, workload[:2])
    # The engine core in this thread (the profiler records the thread that starts it), not EngineLoop's.
    core = EngineCore(config, TorchExecutor(loaded))
    for i, (prompt, out) in enumerate(workload):
        refused = core.add_request(Request(i, list(prompt), out))
        if refused is not None:
            raise SystemExit(f"request {i} refused: {refused.error}")
    output_tokens = 0
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        while core.num_active:
            step = core.step()
            output_tokens += sum(len(r.output_ids) for r in step.responses if r.final)
    wall = time.perf_counter() - start
    events = prof.key_averages()
    rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
    ops_total = sum(e.self_cpu_time_total for e in events) / 1e6
    top = [
        {
            "op": e.key,
            "calls": e.count,
            "self_s": round(e.self_cpu_time_total / 1e6, 3),
            "share_of_wall": round(e.self_cpu_time_total / 1e6 / wall, 4),
        }
        for e in rows[: args.top]
    ]
    print(
        json.dumps(
            {
                "requests": len(workload),
                "output_tokens": output_tokens,
                "wall_s": round(wall, 3),
                "operators_s": round(ops_total, 3),
                "outside_operators_share": round(1 - ops_total / wall, 4),
                "top": top,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
