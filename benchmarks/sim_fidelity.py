#!/usr/bin/env python3
"""How well the simulator, calibrated as a local row, predicts bm's real run on this machine.

    python benchmarks/sim_fidelity.py ../shared/bench/azure-conv-128-x0.25.jsonl \
        --model-config configs/models/bench-llama-15m.json [-c configs/bench.yaml] [--no-calibrate] \
        [--hardware cpu-local|cuda-local]

Calibrates the local row (cpu-local by default; cuda-local on a GPU) unless --no-calibrate, runs ``bm
bench``'s replay for real (torch executor, on that row's device), then the same workload and config under
``--executor sim --hardware ROW``, in one sitting, every request
to its full length. The simulated run measures the model's forward on bm's own engine first (a short
synthetic run, bm.sim.forward_fit) when the calibration has none for it. Prints one JSON object: output
tok/s and p50 TTFT of each, the sim's relative error, the fitted terms and the load averages. Progress
goes to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

from common import log

from bm.bench import run_bench
from bm.bench.simulated import load_sim_model
from bm.config import load_config, parse_override
from bm.runtime import load_model
from bm.sim import LOCAL_ROWS, calibrate
from bm.workloads import load_workload

KEYS = ("output_throughput", "median_ttft_ms", "mean_itl_ms", "duration", "num_iterations")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("workload", type=Path)
    p.add_argument("--model-config", required=True, help="model config JSON (random weights)")
    p.add_argument(
        "-c", "--config", type=Path, default=Path(__file__).parent.parent / "configs" / "bench.yaml"
    )
    p.add_argument("-s", "--set", action="append", default=[], help="bm config override SECTION.KEY=VALUE")
    p.add_argument("--no-calibrate", action="store_true", help="use the cached local row as it is")
    p.add_argument("--hardware", choices=sorted(LOCAL_ROWS), default="cpu-local", help="the local row")
    args = p.parse_args()
    device = LOCAL_ROWS[args.hardware]

    overrides = dict(parse_override(o) for o in args.set)
    overrides |= {
        "model.config": args.model_config,
        "bench.dataset": str(args.workload),
        "bench.ignore_eos": True,
        "model.device": device,  # the real run on the device the row measures
    }
    config = load_config(args.config, overrides)
    if not args.no_calibrate:
        log(f"calibrating {args.hardware} ...")
        row = calibrate(device)
        log(
            f"  {json.dumps({k: row[k] for k in ('flops', 'memory_bw', 'iteration_overhead_s', 'layer_overhead_s')})}"
        )
    loaded = load_model(config.model)
    workload = load_workload(config.bench, vocab_size=loaded.vocab_size, encode=None)

    log("real run (torch executor) ...")
    started = time.perf_counter()
    real = run_bench(config, loaded, workload).metrics
    real_wall = time.perf_counter() - started

    sim_config = dataclasses.replace(
        config,
        engine=dataclasses.replace(config.engine, executor="sim"),
        sim=dataclasses.replace(config.sim, hardware=args.hardware),
    )
    log(f"simulated run ({args.hardware}) ...")
    load_before = os.getloadavg()
    sim_model = load_sim_model(sim_config)
    sim = run_bench(sim_config, sim_model, workload).metrics
    fit = sim_model.cost_model().fit

    def error(key: str) -> float | None:
        return (sim[key] - real[key]) / real[key] if real.get(key) else None

    print(
        json.dumps(
            {
                "workload": str(args.workload),
                "model_config": args.model_config,
                "real": {k: real.get(k) for k in KEYS} | {"wall_s": real_wall},
                "sim": {k: sim.get(k) for k in KEYS} | {"wall_s": sim["wall_time_s"]},
                "forward_fit": fit,
                "load_average": {"before_sim": load_before, "end": os.getloadavg()},
                "error": {
                    "output_throughput": error("output_throughput"),
                    "median_ttft_ms": error("median_ttft_ms"),
                    "mean_itl_ms": error("mean_itl_ms"),
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
