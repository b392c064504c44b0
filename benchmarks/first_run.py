#!/usr/bin/env python3
"""The first `bm bench` run in a process against the second: does the first pay for start-up inside the clock?

    python benchmarks/first_run.py --model-config configs/models/bench-llama-15m.json
    python benchmarks/first_run.py --model-config configs/models/smollm2-135m-shape.json --rounds 3 \\
        --beside '.venv/bin/python -m pytest tests/test_kv_cache.py tests/test_scheduler.py -q'

Each round starts a fresh Python process that does what ``bm bench`` does (the model and the dataset
loaded by ``bm.cli.bench.load_model_and_workload``, the cache sized by ``engine_config``) and then calls
:func:`bm.bench.run_bench` ``--runs`` times on the same model, workload and arrivals (the reference
workload's first 64 rows, EOS ignored, all sent at t=0, by default). The first run's figures over the
second's are the ratios: output tok/s and mean TTFT within 10% means the first run measures the workload,
not start-up. The first iteration's latency of each run is ``stats.jsonl``'s "Iteration Latency (ms)" of
iteration 1. Each run's CPU time (``cpu_s``, the process's over the replay) is reported beside the
wall-clock figures: on a loaded machine the wall clock of two runs moves by tens of percent with what
else runs, while a cost the first run pays itself (page faults, kernel loads, threads spinning at a
barrier) shows in its CPU time.

``--beside CMD`` runs ``CMD`` in a loop beside the whole measurement (the machine's load average is
reported either way); ``--code DIR`` imports bm from another checkout, e.g. the commit before a change,
so the two alternate in one sitting (``--code`` may be given several times: each round runs each, in
order). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKLOAD = REPO.parent / "shared" / "bench" / "azure-conv-128-x0.25.jsonl"

CHILD = r"""
import json, os, resource, sys, time
from rich.console import Console
from bm.bench import run_bench, runner
from bm.cli.bench import engine_config, load_model_and_workload
from bm.config import load_config, parse_override
from bm.workloads import arrival_times

args = json.loads(sys.argv[1])
overrides = {"bench.dataset": args["workload"], "bench.num_requests": args["rows"],
             "bench.ignore_eos": True, "model.config": args["model_config"], "model.preset": args["model"]}
overrides.update(dict(parse_override(o) for o in args["set"]))
cfg = load_config(None, {k: v for k, v in overrides.items() if v is not None})
console = Console(file=open(os.devnull, "w"))
started = time.perf_counter()
loaded, workload = load_model_and_workload(cfg, console)
cfg = engine_config(cfg, loaded, workload, console)
arrivals = arrival_times(workload, cfg.bench)


class Stats:
    def __init__(self):
        self.rows = []

    def add_stats(self, rows):
        self.rows.extend(rows)

    def add_requests(self, records):
        pass


# the process's usage when each run's engine is built (warm-up done), just before its replay starts
built = []
build = runner.engine_loop


def engine_loop(*args, **kwargs):
    manager = build(*args, **kwargs)
    built.append(resource.getrusage(resource.RUSAGE_SELF))
    return manager


runner.engine_loop = engine_loop
runs = []
for _ in range(args["runs"]):
    stats = Stats()
    result = run_bench(cfg, loaded, workload, arrivals, journal=stats)
    after = resource.getrusage(resource.RUSAGE_SELF)
    before = built.pop()
    latencies = [row["Iteration Latency (ms)"] for row in stats.rows]
    warm = result.startup.get("warmup") or {}
    runs.append({
        "output_tok_s": result.metrics["output_throughput"],
        "mean_ttft_ms": result.metrics["mean_ttft_ms"],
        "duration_s": result.duration_s,
        # this process's CPU time over the replay (after the engine was built): what load beside it does
        # not inflate
        "cpu_s": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime,
        "minor_faults": after.ru_minflt - before.ru_minflt,
        "first_iterations_ms": latencies[:5],
        "median_iteration_ms": sorted(latencies)[len(latencies) // 2] if latencies else None,
        "engine_build_s": result.startup.get("engine_build_s"),
        "warmup_s": warm.get("seconds"),
        "warmup_shapes": warm.get("shapes"),
        "warmup_threads": warm.get("threads"),
        "load_avg": os.getloadavg()[0],
    })
import bm
print(json.dumps({"bm_file": bm.__file__, "load_model_s": loaded.load_seconds, "runs": runs}))
"""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model-config", help="model config JSON (random weights)")
    model.add_argument("--model", help="a model.preset name or a checkpoint directory")
    p.add_argument(
        "--workload", type=Path, default=WORKLOAD, help="bench dataset (default: the reference one)"
    )
    p.add_argument("-n", "--rows", type=int, default=64, help="first N rows (default 64)")
    p.add_argument("--runs", type=int, default=2, help="run_bench calls per process (default 2)")
    p.add_argument("--rounds", type=int, default=1, help="fresh processes per code tree (default 1)")
    p.add_argument("-s", "--set", action="append", default=[], help="bm config override SECTION.KEY=VALUE")
    p.add_argument("--beside", help="a shell command run in a loop beside the measurement (the load)")
    p.add_argument("--code", action="append", type=Path, help="import bm from this checkout (repeatable)")
    args = p.parse_args()
    if not args.model and not args.model_config:
        args.model_config = str(REPO / "configs" / "models" / "bench-llama-15m.json")
    if args.runs < 2:
        p.error("--runs: at least 2 (the first run is compared with the second)")
    return args


def child(args: argparse.Namespace, code: Path | None) -> dict:
    payload = {
        "workload": str(args.workload.resolve()),
        "rows": args.rows,
        "model_config": str(Path(args.model_config).resolve()) if args.model_config else None,
        "model": args.model,
        "set": args.set,
        "runs": args.runs,
    }
    env = dict(os.environ)
    tree = (code or REPO).resolve()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), env.get("PYTHONPATH")]))
    # run from the tree: ``python -c`` puts the working directory first on sys.path
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(payload)], capture_output=True, text=True, env=env, cwd=tree
    )
    if done.returncode == 0 and "bm_file" not in done.stdout:
        raise SystemExit("the child did not say which bm it imported")
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    out = json.loads(done.stdout.strip().splitlines()[-1])
    first, second = out["runs"][0], out["runs"][1]
    out["first_over_second"] = {
        "output_tok_s": first["output_tok_s"] / second["output_tok_s"],
        "mean_ttft_ms": first["mean_ttft_ms"] / second["mean_ttft_ms"],
        "first_iteration_ms": first["first_iterations_ms"][0] / second["first_iterations_ms"][0],
        "cpu_s": first["cpu_s"] / second["cpu_s"],
    }
    return out


def start_load(command: str | None) -> subprocess.Popen | None:
    if not command:
        return None
    return subprocess.Popen(
        ["bash", "-c", f"while true; do {command}; done"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip


def stop_load(load: subprocess.Popen | None) -> None:
    if load is not None:
        os.killpg(load.pid, signal.SIGTERM)  # the loop and the command it runs: its own session
        load.wait()


def main() -> None:
    args = parse_args()
    trees = args.code or [None]
    load = start_load(args.beside)
    try:
        if load is not None:
            time.sleep(10)  # let the load settle in before the first round
        load_before = os.getloadavg()
        rounds = [{str(t or REPO): child(args, t) for t in trees} for _ in range(args.rounds)]
    finally:
        stop_load(load)
    summary = {}
    for tree in (str(t or REPO) for t in trees):
        ratios = [r[tree]["first_over_second"] for r in rounds]
        summary[tree] = {
            key: {
                "median": statistics.median(x[key] for x in ratios),
                "each": [round(x[key], 3) for x in ratios],
            }
            for key in ratios[0]
        } | {
            "first_iteration_ms": {
                "first_run": [r[tree]["runs"][0]["first_iterations_ms"][0] for r in rounds],
                "second_run": [r[tree]["runs"][1]["first_iterations_ms"][0] for r in rounds],
            }
        }
    report = {
        "model": args.model or args.model_config,
        "workload": f"{args.workload} (first {args.rows} rows, EOS ignored, all at t=0)",
        "set": args.set,
        "beside": args.beside,
        "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
        "first_over_second": summary,
        "rounds": rounds,
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
