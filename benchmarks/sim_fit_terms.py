#!/usr/bin/env python3
"""Which forward-fit terms a local row should fit: one set of timed forwards, fitted with each set of
terms, each fit priced by the simulator against one real run of the same workload, in one sitting.

    python benchmarks/sim_fit_terms.py ../shared/bench/azure-conv-128-x0.25.jsonl \\
        --model-config configs/models/bench-llama-15m.json [--hardware cpu-local|cuda-local]

Calibrates the row, runs ``bm bench``'s replay for real on the row's device, times the device's designed
forwards once (bm.sim.forward_fit.time_design), then for each variant (the row's own terms, with
per_context_forward, with per_key, all six) fits those same samples and replays the workload under the
simulator. Fitting every variant on the same samples keeps the fit's own noise out of the comparison; the
real run's is still in it (run it twice on a shared machine). Prints one JSON object; progress to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

import yaml
from common import log

from bm.bench import run_bench
from bm.bench.simulated import load_sim_model
from bm.config import load_config
from bm.runtime import load_model
from bm.sim import LOCAL_ROWS, calibrate
from bm.sim import forward_fit as ff
from bm.sim.hardware import local_row_path
from bm.sim.model import ModelShape
from bm.workloads import load_workload

KEYS = ("output_throughput", "median_ttft_ms", "mean_itl_ms")


def variants(own: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """The row's own terms, each of the two GPU terms added alone, and all six."""
    with_term = {f"+{t}": tuple(x for x in ff.TERMS if x in own or x == t) for t in ff.TERMS if t not in own}
    return {"own": own} | with_term | {"all": ff.TERMS}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("workload", type=Path)
    p.add_argument("--model-config", required=True, help="model config JSON (random weights)")
    p.add_argument(
        "-c", "--config", type=Path, default=Path(__file__).parent.parent / "configs" / "bench.yaml"
    )
    p.add_argument("--hardware", choices=sorted(LOCAL_ROWS), default="cpu-local", help="the local row")
    args = p.parse_args()
    device = LOCAL_ROWS[args.hardware]
    config = load_config(
        args.config,
        {"model.config": args.model_config, "bench.dataset": str(args.workload), "bench.ignore_eos": True,
         "model.device": device},
    )  # fmt: skip
    log(f"calibrating {args.hardware} ...")
    calibrate(device)
    loaded = load_model(config.model)
    workload = load_workload(config.bench, vocab_size=loaded.vocab_size, encode=None)
    out: dict = {"load_average": {"start": os.getloadavg()}}
    log("real run (torch executor) ...")
    real = run_bench(config, loaded, workload).metrics
    out["real"] = {k: real[k] for k in KEYS}
    out["load_average"]["after_real"] = os.getloadavg()
    design = ff.cuda_design() if loaded.device.type == "cuda" else ff.cpu_design()
    log("timing the designed forwards ...")
    model_config = dataclasses.replace(config.model, device=str(loaded.device), cuda_graphs="auto")
    samples = ff.time_design(loaded, model_config, design)
    out["load_average"]["after_fit"] = os.getloadavg()
    dtype = str(loaded.dtype).removeprefix("torch.")
    key = ff.model_key(ModelShape.from_file(args.model_config).shape_dict(), dtype)
    sim_config = dataclasses.replace(
        config,
        engine=dataclasses.replace(config.engine, executor="sim"),
        sim=dataclasses.replace(config.sim, hardware=args.hardware),
        model=dataclasses.replace(config.model, dtype=dtype),
    )
    path = local_row_path(args.hardware)
    for name, terms in variants(design.terms).items():
        fit = ff.fit_samples(samples, terms)
        row = yaml.safe_load(path.read_text(encoding="utf-8"))
        row["forward_fits"] = {key: fit}
        path.write_text(yaml.safe_dump(row, sort_keys=False), encoding="utf-8")
        sim = run_bench(sim_config, load_sim_model(sim_config), workload).metrics
        error = {k: (sim[k] - real[k]) / real[k] for k in KEYS}
        out[name] = {"terms": fit["terms"], "r2": fit["r2"], "error": error}
        log(f"  {name}: " + ", ".join(f"{k} {v:+.1%}" for k, v in error.items()))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
