#!/usr/bin/env python3
"""Output throughput of each batching scheme on one workload, measured in the same run.

    python benchmarks/schemes.py WORKLOAD.jsonl --model-config CFG.json [-c configs/bench.yaml]
        [--schemes v1,inflight,inflight_fused] [--policy guaranteed_no_evict]

Everything is submitted at t=0 and run to its full length (end tokens ignored), on the same seeded
random weights. Prints one JSON object with each scheme's figures and inflight_fused's ratio to v1.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import log, read_workload, run_bm

from bm.config import load_config, parse_override
from bm.runtime import load_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("workload", type=Path)
    p.add_argument("--model-config", required=True)
    p.add_argument(
        "-c", "--config", type=Path, default=Path(__file__).parent.parent / "configs" / "bench.yaml"
    )
    p.add_argument("-s", "--set", action="append", default=[], help="bm config override SECTION.KEY=VALUE")
    p.add_argument("--schemes", default="v1,inflight,inflight_fused")
    p.add_argument("--policy", default="guaranteed_no_evict")
    p.add_argument("--limit", type=int, default=None)
    args = p.parse_args()

    overrides = dict(parse_override(o) for o in args.set)
    overrides.update(
        {"model.config": args.model_config, "model.path": None, "engine.scheduler_policy": args.policy}
    )
    base = load_config(args.config, overrides)
    workload = read_workload(args.workload, args.limit)
    loaded = load_model(base.model)
    run_bm(loaded, base, workload[:4])  # warm-up
    report: dict = {"workload": str(args.workload), "policy": args.policy, "bm_config": base.to_dict()}
    for scheme in args.schemes.split(","):
        config = load_config(args.config, {**overrides, "engine.batching_scheme": scheme})
        result, stats = run_bm(loaded, config, workload)
        report[scheme] = {
            **result.to_dict(),
            "iterations": len(stats),
            "computed_tokens": sum(s["Computed Tokens"] for s in stats),
            "empty_generation_slots": sum(s["Empty Generation Slots"] for s in stats),
            "padded_context_tokens": sum(s["Padded Context Tokens"] for s in stats),
        }
        log(f"{scheme}: {result.output_tok_s:.1f} output tok/s in {result.wall_s:.2f} s")
    if "v1" in report and "inflight_fused" in report:
        report["inflight_fused/v1"] = round(
            report["inflight_fused"]["output_tok_s"] / report["v1"]["output_tok_s"], 2
        )
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
