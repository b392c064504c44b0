"""The results document of a run: what was run (config, version, model, dataset, seed), then the metrics.

Metric keys sit at the top level, as in ``vllm bench serve --save-result``, so scripts written for vLLM
read ``request_throughput`` or ``p99_ttft_ms`` from bm's file unchanged.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pandas as pd

import bm
from bm.bench.metrics import engine_metrics, run_metrics
from bm.bench.runner import BenchRun
from bm.config import BmConfig
from bm.workloads import Workload


def stats_frame(lines: list[str]) -> pd.DataFrame:
    return pd.DataFrame.from_records([json.loads(line) for line in lines]) if lines else pd.DataFrame()


def summarize(run: BenchRun, config: BmConfig, model_name: str, workload: Workload) -> dict[str, Any]:
    bench = config.bench
    records = (
        pd.DataFrame.from_records(run.records)
        if run.records
        else pd.DataFrame(columns=["ok", "input_tokens", "output_tokens", "num_pauses", "itl_ms"])
    )
    if len(records):
        records = records.sort_values("index", kind="stable")
    slo = {"ttft": bench.slo_ttft_ms, "tpot": bench.slo_tpot_ms, "e2el": bench.slo_e2el_ms}
    return {
        "bm_version": bm.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": model_name,
        "dataset": workload.describe(),
        "seed": bench.seed,
        "arrivals": run.arrivals.describe() | {"max_concurrency": bench.max_concurrency},
        "warmup": bench.warmup,
        "slo_ms": {k: v for k, v in slo.items() if v is not None},
        "interrupted": run.interrupted,
        "config": config.to_dict(),
        **run_metrics(records, run.duration_s, slo),
        **engine_metrics(stats_frame(run.stats_lines), records),
    }
