#!/usr/bin/env python3
"""Offline throughput of bm against HF generate() and transformers' continuous batching, same process.

    python benchmarks/throughput.py WORKLOAD.jsonl --model-config CFG.json [-c configs/bench.yaml]

WORKLOAD.jsonl holds one request a line with ``input_ids`` and ``request_output_len`` (arrival times, if
any, are ignored: everything is submitted at t=0). Every run uses the same random weights (seeded) and
runs every request to its full length (end tokens ignored). Prints one JSON object: output tok/s of
each, and bm's ratio to each peer. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from common import log, read_workload, run_bm

from bm.baselines import run_hf_continuous_batching, run_hf_generate
from bm.config import load_config, parse_override
from bm.runtime import load_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("workload", type=Path)
    p.add_argument("--model-config", required=True, help="model config JSON (random weights)")
    p.add_argument(
        "-c", "--config", type=Path, default=Path(__file__).parent.parent / "configs" / "bench.yaml"
    )
    p.add_argument("-s", "--set", action="append", default=[], help="bm config override SECTION.KEY=VALUE")
    p.add_argument("--limit", type=int, default=None, help="first N requests only")
    p.add_argument("--peers", default="hf-generate,hf-cb", help="comma list of hf-generate, hf-cb (or none)")
    p.add_argument("--batch-size", type=int, default=16, help="hf-generate's static batch size")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = p.parse_args()

    overrides = dict(parse_override(o) for o in args.set)
    overrides.update({"model.config": args.model_config, "model.seed": args.seed, "model.path": None})
    config = load_config(args.config, overrides)
    workload = read_workload(args.workload, args.limit)
    loaded = load_model(config.model)
    log(f"workload: {len(workload)} requests, {sum(len(x) for x, _ in workload)} prompt tokens, "
        f"{sum(n for _, n in workload)} output tokens; torch threads {torch.get_num_threads()}")  # fmt: skip

    run_bm(loaded, config, workload[:4])  # warm-up: first-call allocations and kernel selection
    bm_result, stats = run_bm(loaded, config, workload)
    log(
        f"bm: {bm_result.output_tok_s:.1f} output tok/s in {bm_result.wall_s:.2f} s ({len(stats)} iterations)"
    )
    results = {"bm": bm_result}
    peers = [x for x in args.peers.split(",") if x and x != "none"]
    for name in peers:
        if name == "hf-generate":
            results[name] = run_hf_generate(loaded.model, workload, batch_size=args.batch_size)
        elif name == "hf-cb":
            results[name] = run_hf_continuous_batching(loaded.model, workload)
        else:
            raise SystemExit(f"unknown peer {name!r}; known: hf-generate, hf-cb")
        log(f"{name}: {results[name].output_tok_s:.1f} output tok/s in {results[name].wall_s:.2f} s")

    report = {
        "workload": str(args.workload),
        "model_config": args.model_config,
        "device": str(loaded.device),
        "torch_threads": torch.get_num_threads(),
        "bm_config": config.to_dict(),
        "iterations": len(stats),
        **{name: r.to_dict() for name, r in results.items()},
        "ratios": {
            f"bm/{name}": round(bm_result.output_tok_s / results[name].output_tok_s, 2)
            for name in peers
            if results[name].output_tok_s > 0
        },
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
