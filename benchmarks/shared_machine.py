"""bm's CPU throughput with and without ``model.yield_cores``, on a quiet machine or beside a busy loop.

    python benchmarks/shared_machine.py                 # quiet: the two settings, alternated
    python benchmarks/shared_machine.py --busy          # the same beside one process spinning on a core

Each round starts one process per setting (off, then auto), each loading the embedded model and timing
``--repeats`` runs of the same synthetic workload (``bm.bench.run_bench``), so the settings alternate in
one sitting. Prints JSON: every repeat's output tok/s per setting and round, the medians, and the load
average before and after (a figure measured beside someone else's job says so).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = """
import json, sys
from rich.console import Console
from bm.bench.runner import run_bench
from bm.cli.bench import engine_config, load_model_and_workload, pin_cache
from bm.config import config_from_dict
from bm.workloads import arrival_times
setting, requests, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cfg = config_from_dict({"model": {"yield_cores": setting}, "bench": {"dataset_kind": "synthetic",
    "input_len": 128, "output_len": 128, "num_requests": requests, "ignore_eos": True}})
console = Console(file=open("/dev/null", "w"))
loaded, workload = load_model_and_workload(cfg, console)
cfg = pin_cache(engine_config(cfg, loaded, workload, console), loaded)
arrivals = arrival_times(workload, cfg.bench)
print(json.dumps([run_bench(cfg, loaded, workload, arrivals).metrics["output_throughput"] for _ in range(repeats)]))
"""


def run_setting(setting: str, requests: int, repeats: int) -> list[float]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-c", CHILD, setting, str(requests), str(repeats)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env, cwd=REPO)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--busy", action="store_true", help="run a spinning process beside bm")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32)
    args = parser.parse_args()
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    load_before = os.getloadavg()
    figures: dict[str, list[list[float]]] = {"off": [], "auto": []}
    try:
        for _ in range(args.rounds):
            for setting in figures:
                figures[setting].append(run_setting(setting, args.requests, args.repeats))
    finally:
        if spinner is not None:
            spinner.kill()
    print(
        json.dumps(
            {
                "busy_loop_beside": args.busy,
                "workload": f"{args.requests} requests x 128/128 tokens, embedded model",
                "output_tok_s": {k: [[round(x) for x in r] for r in v] for k, v in figures.items()},
                "median_output_tok_s": {
                    k: round(statistics.median(x for r in v for x in r)) for k, v in figures.items()
                },
                "load_average_before": load_before,
                "load_average_after": os.getloadavg(),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
