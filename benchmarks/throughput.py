#!/usr/bin/env python3
"""Offline throughput of bm against its peers on one workload, every figure from one run.

    python benchmarks/throughput.py WORKLOAD.jsonl (--model-config CFG.json | --model DIR)
        [--peers hf-generate,hf-cb,vllm-cpu] [--roofline] [--baseline-set KEY=VALUE] [-c configs/bench.yaml]

WORKLOAD.jsonl holds one request a line with ``input_ids`` and ``request_output_len`` (arrival times, if
any, are ignored: everything is submitted at t=0). Every run runs every request to its full length (end
tokens ignored). ``vllm-cpu`` runs ``../shared/bench/vllm_peer.py`` in vLLM's own virtual environment
(``--vllm-python``, see ../shared/bench/README.md) on the identical workload and model shape (random
weights). ``--roofline`` measures this machine's fp32 GEMM peak in the same run (before and after the
runs, keeping the higher) and reports the workload's matmul roofline and bm's fraction of it.
``--baseline-set`` runs bm a second time with an optimisation switched off, for its before/after ratio
from the same run. Prints one JSON object; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

import torch
from common import add_model_arguments, log, model_overrides, read_workload, run_bm
from roofline import measure_gemm_peak, workload_flops

from bm.baselines import PeerResult, run_hf_continuous_batching, run_hf_generate
from bm.config import load_config, parse_override
from bm.runtime import load_model

REPO = Path(__file__).resolve().parent.parent
VLLM_PEER = REPO.parent / "shared" / "bench" / "vllm_peer.py"


def run_vllm(python: str, workload_path: Path, hf_config, limit: int | None) -> PeerResult:
    """vLLM's CPU build in its own interpreter, on a directory holding only this model's config.json."""
    if not VLLM_PEER.is_file():
        raise SystemExit(f"vllm-cpu: {VLLM_PEER} not found (it lives in ../shared/bench/)")
    with tempfile.TemporaryDirectory() as model_dir:
        hf_config.save_pretrained(model_dir)
        cmd = [python, str(VLLM_PEER), str(workload_path), model_dir]
        if limit:
            cmd += ["--limit", str(limit)]
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1"),
               "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"vllm-cpu failed ({done.returncode}): {done.stderr[-2000:]}")
    row = json.loads(lines[-1])
    prompt_tokens = round(row["total_tok_s"] * row["wall_s"]) - row["output_tokens"]
    return PeerResult("vllm-cpu", row["requests"], prompt_tokens, row["output_tokens"], row["wall_s"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("workload", type=Path)
    add_model_arguments(p)
    p.add_argument("--limit", type=int, default=None, help="first N requests only")
    p.add_argument(
        "--peers", default="hf-generate,hf-cb", help="comma list of hf-generate, hf-cb, vllm-cpu (or none)"
    )
    p.add_argument(
        "--vllm-python",
        default=os.environ.get("BM_VLLM_PYTHON", str(REPO.parent / "vllm-venv" / "bin" / "python")),
        help="the python of vLLM's CPU build's own virtual environment",
    )
    p.add_argument("--roofline", action="store_true", help="measure the GEMM peak and report bm's fraction")
    p.add_argument(
        "--baseline-set",
        action="append",
        default=[],
        help="also run bm with these overrides (e.g. model.prepack=off) and report the ratio: one "
        "optimisation's before/after in one run",
    )
    p.add_argument("--batch-size", type=int, default=16, help="hf-generate's static batch size")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = p.parse_args()

    overrides = model_overrides(args, args.seed)
    config = load_config(args.config, overrides)
    workload = read_workload(args.workload, args.limit)
    loaded = load_model(config.model)
    log(f"workload: {len(workload)} requests, {sum(len(x) for x, _ in workload)} prompt tokens, "
        f"{sum(n for _, n in workload)} output tokens; torch threads {torch.get_num_threads()}")  # fmt: skip

    peaks = [measure_gemm_peak()] if args.roofline else []
    results = {}
    if args.baseline_set:
        base_overrides = {**overrides, **dict(parse_override(o) for o in args.baseline_set)}
        base_config = load_config(args.config, base_overrides)
        base_loaded = load_model(base_config.model)
        run_bm(base_loaded, base_config, workload[:4])
        results["bm-baseline"], _ = run_bm(base_loaded, base_config, workload)
        del base_loaded
        log(
            f"bm-baseline ({', '.join(args.baseline_set)}): {results['bm-baseline'].output_tok_s:.1f} output tok/s"
        )
    run_bm(loaded, config, workload[:4])  # warm-up: first-call allocations and kernel selection
    bm_result, stats = run_bm(loaded, config, workload)
    log(
        f"bm: {bm_result.output_tok_s:.1f} output tok/s in {bm_result.wall_s:.2f} s ({len(stats)} iterations)"
    )
    results = {"bm": bm_result, **results}
    peers = [x for x in args.peers.split(",") if x and x != "none"]
    for name in peers:
        if name == "hf-generate":
            results[name] = run_hf_generate(loaded.model, workload, batch_size=args.batch_size)
        elif name == "hf-cb":
            results[name] = run_hf_continuous_batching(loaded.model, workload)
        elif name == "vllm-cpu":
            results[name] = run_vllm(args.vllm_python, args.workload, loaded.model.config, args.limit)
        else:
            raise SystemExit(f"unknown peer {name!r}; known: hf-generate, hf-cb, vllm-cpu")
        log(f"{name}: {results[name].output_tok_s:.1f} output tok/s in {results[name].wall_s:.2f} s")

    roofline = None
    if args.roofline:
        # measured before and after every run; the higher one counts, so a slow moment never flatters bm
        peaks.append(measure_gemm_peak())
        peak = max(peaks)
        flops = workload_flops(loaded.model.config, workload)
        roofline = {
            "gemm_peak_gflop_s": round(peak / 1e9, 1),
            "gemm_peak_measurements_gflop_s": [round(x / 1e9, 1) for x in peaks],
            "workload_tflop": round(flops / 1e12, 3),
            "roofline_s": round(flops / peak, 2),
            "bm_wall_s": round(bm_result.wall_s, 2),
            "bm_fraction_of_roofline": round(flops / peak / bm_result.wall_s, 3),
        }
        for name, r in results.items():
            if name != "bm" and r.wall_s > 0:  # peers and the baseline
                roofline[f"{name}_fraction_of_roofline"] = round(flops / peak / r.wall_s, 3)
        log(f"roofline: {roofline}")

    report = {
        "workload": str(args.workload),
        "model_config": args.model_config,
        "model": args.model,
        "device": str(loaded.device),
        "torch_threads": torch.get_num_threads(),
        "bm_config": config.to_dict(),
        "iterations": len(stats),
        **{name: r.to_dict() for name, r in results.items()},
        "roofline": roofline,
        "baseline_set": args.baseline_set,
        "ratios": {
            f"bm/{name}": round(bm_result.output_tok_s / r.output_tok_s, 2)
            for name, r in results.items()
            if name != "bm" and r.output_tok_s > 0
        },
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
