"""A run's result, built in one place for real and simulated runs, and on disk: ``results.json``, ``requests.jsonl`` and ``stats.jsonl``.

``results.json`` says what was run (the full resolved config, bm's version, the model, the dataset, the
seed and the arrivals), then the metrics. Metric keys sit at the top level, as in ``vllm bench serve
--save-result``, so scripts written for vLLM read ``request_throughput`` or ``p99_ttft_ms`` from bm's
file unchanged.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

import bm
from bm.bench.metrics import RECORD_COLUMNS, engine_metrics, request_record, run_metrics
from bm.bench.replayer import Replayer
from bm.config import BmConfig
from bm.distributed import parallel_info
from bm.engine.request import Request
from bm.workloads import ArrivalPlan, Workload


@dataclass(frozen=True)
class ReplayProgress:
    """A snapshot for a progress display: counts since the measured replay started."""

    num_requests: int
    num_finished: int
    num_output_tokens: int
    elapsed_s: float


@dataclass
class BenchResult:
    """Everything one run measured, plus what it ran (for the results document)."""

    records: pd.DataFrame  # one row per request of the workload, in workload order
    stats: list[dict[str, Any]]  # per-iteration stats of the measured replay
    metrics: dict[str, Any]  # run_metrics + engine_metrics, vllm bench serve's key names
    duration_s: float
    interrupted: bool = False
    config: BmConfig = field(default_factory=BmConfig)
    model_name: str = ""
    workload: dict[str, Any] = field(default_factory=dict)  # Workload.describe()
    arrivals: dict[str, Any] = field(default_factory=dict)  # ArrivalPlan.describe()
    runtime: dict[str, Any] = field(default_factory=dict)  # bm.runtime.native.runtime_info()


def bench_result(
    config: BmConfig,
    model_name: str,
    workload: Workload,
    built: Sequence[tuple[int, Request]],
    replayer: Replayer,
    stats: list[dict[str, Any]],
    *,
    runtime: dict[str, Any],
    interrupted: bool = False,
) -> BenchResult:
    """The one place a run's result is built, real or simulated: a record per workload row (in workload
    order, from the replayer's timelines), the run's duration (the last request done), then the request
    and engine metrics under the run's SLOs. The simulator adds its cost and clock figures on top."""
    bench = config.bench
    timelines = {index: replayer.timelines[r.request_id] for index, r in built}
    records = records_frame(
        [request_record(i, req, timelines.get(i)) for i, req in enumerate(workload.requests)]
    )
    done = [t.done_s for t in timelines.values() if t.done_s is not None and t.send_s is not None]
    duration = max(done, default=0.0)
    slo = {"ttft": bench.slo_ttft_ms, "tpot": bench.slo_tpot_ms, "e2el": bench.slo_e2el_ms}
    metrics = run_metrics(records, duration, slo) | engine_metrics(pd.DataFrame.from_records(stats), records)
    return BenchResult(
        records=records,
        stats=stats,
        metrics=metrics,
        duration_s=duration,
        interrupted=interrupted,
        config=config,
        model_name=model_name,
        workload=workload.describe(),
        arrivals=ArrivalPlan.from_config(bench).describe() | {"max_concurrency": bench.max_concurrency},
        runtime=runtime,
    )


def records_frame(records: list[dict[str, Any]]) -> pd.DataFrame:
    """Per-request records as a frame with every column present, even for an empty run."""
    return pd.DataFrame.from_records(records, columns=list(RECORD_COLUMNS))


def snapshot(replayer: Replayer) -> ReplayProgress:
    """The replay's progress now, for a progress display."""
    return ReplayProgress(
        num_requests=replayer.num_requests,
        num_finished=replayer.num_finished,
        num_output_tokens=replayer.num_output_tokens,
        elapsed_s=replayer.now(),
    )


def results_document(result: BenchResult) -> dict[str, Any]:
    bench = result.config.bench
    slo = {"ttft": bench.slo_ttft_ms, "tpot": bench.slo_tpot_ms, "e2el": bench.slo_e2el_ms}
    return json_safe(
        {
            "bm_version": bm.__version__,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "model": result.model_name,
            "dataset": result.workload,
            "seed": bench.seed,
            "batching_scheme": result.config.engine.batching_scheme,
            "scheduler_policy": result.config.engine.scheduler_policy,
            "arrivals": result.arrivals,
            "request_rate": bench.request_rate if bench.request_rate is not None else "inf",
            "burstiness": bench.burstiness,
            "max_concurrency": bench.max_concurrency,
            "warmup": bench.warmup,
            "slo_ms": {k: v for k, v in slo.items() if v is not None},
            "interrupted": result.interrupted,
            "config": result.config.to_dict(),
            "runtime": result.runtime,
            "parallel": parallel_info(),
            **result.metrics,
        }
    )


def write_results(out_dir: Path, result: BenchResult) -> dict[str, Any]:
    """Write the three files into ``out_dir`` (created if needed); returns the results document."""
    out_dir.mkdir(parents=True, exist_ok=True)
    document = results_document(result)
    (out_dir / "results.json").write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    with (out_dir / "requests.jsonl").open("w", encoding="utf-8") as f:
        for record in result.records.to_dict("records"):
            f.write(json.dumps(json_safe(record), ensure_ascii=False) + "\n")
    with (out_dir / "stats.jsonl").open("w", encoding="utf-8") as f:
        for stats in result.stats:
            f.write(json.dumps(stats) + "\n")
    return document


def json_safe(value: Any) -> Any:
    """Plain, strict JSON: NaN (pandas' missing value) and infinities become null, numpy scalars become
    Python numbers, tuples lists."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        # a request's token gaps are long lists of plain floats: pass them whole
        return list(value) if _plain_numbers(value) else [json_safe(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _plain_numbers(values: list | tuple) -> bool:
    """Every item a finite Python float or int (not a bool, numpy scalar or container)."""
    for v in values:
        kind = type(v)
        if kind is float:
            if not math.isfinite(v):
                return False
        elif kind is not int:
            return False
    return True
