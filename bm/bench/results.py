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
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

import bm
from bm.bench.journal import RunFeed
from bm.bench.metrics import PERCENTILES, RECORD_COLUMNS
from bm.bench.replayer import Replayer
from bm.bench.tally import RequestTally, StatsTally
from bm.config import BmConfig
from bm.files import replacing_text
from bm.parallel import parallel_info
from bm.workloads import ArrivalPlan, Workload


@dataclass(frozen=True)
class ReplayProgress:
    """A snapshot for a progress display: counts since the measured replay started."""

    num_requests: int
    num_finished: int
    num_output_tokens: int
    elapsed_s: float
    num_expected_output_tokens: int | None = None  # the run's output tokens, when known in advance


@dataclass
class BenchResult:
    """Everything one run measured, plus what it ran (for the results document).

    A run keeps no record or stats row: they went to the run's journal as they came (the files
    ``requests.jsonl`` and ``stats.jsonl`` under ``bm bench``); what stays is their tallies."""

    requests: RequestTally  # per request, in workload order: what the latency statistics and SLOs need
    iterations: StatsTally  # the per-iteration stats of the measured replay, summed
    metrics: dict[str, Any]  # run_metrics + engine_metrics, vllm bench serve's key names
    duration_s: float
    interrupted: bool = False
    config: BmConfig = field(default_factory=BmConfig)
    model_name: str = ""
    workload: dict[str, Any] = field(default_factory=dict)  # Workload.describe()
    arrivals: dict[str, Any] = field(default_factory=dict)  # ArrivalPlan.describe()
    runtime: dict[str, Any] = field(default_factory=dict)  # bm.runtime.native.runtime_info()
    # before the clock: engine_build_s (cache and warm-up), warmup (its report), load_model_s (the CLI's)
    startup: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # what the engine said during the run (once each)
    not_run: int = 0  # requests a stop rule ended unsent or unfinished (bm sweep's early stop)


def bench_result(
    config: BmConfig,
    model_name: str,
    workload: Workload,
    replayer: Replayer,
    feed: RunFeed,
    *,
    runtime: dict[str, Any],
    interrupted: bool = False,
) -> BenchResult:
    """The one place a run's result is built, real or simulated, once ``feed`` has every request's
    record (:meth:`RunFeed.finish`): the run's duration (the last request done), then the request and
    engine metrics under the run's SLOs, from the feed's tallies. The simulator adds its cost and clock
    figures on top."""
    bench = config.bench
    done = [t.done_s for t in replayer.timelines.values() if t.done_s is not None and t.send_s is not None]
    duration = max(done, default=0.0)
    slo = {"ttft": bench.slo_ttft_ms, "tpot": bench.slo_tpot_ms, "e2el": bench.slo_e2el_ms}
    requests = feed.requests
    requests.close()
    metrics = requests.metrics(
        duration, slo, report_percentiles(bench.metric_percentiles)
    ) | feed.stats.metrics(requests.num_paused_requests, requests.total_pauses)
    return BenchResult(
        requests=requests,
        iterations=feed.stats,
        metrics=metrics,
        duration_s=duration,
        interrupted=interrupted,
        config=config,
        model_name=model_name,
        workload=workload.describe(),
        arrivals=ArrivalPlan.from_config(bench).describe() | {"max_concurrency": bench.max_concurrency},
        runtime=runtime,
    )


def report_percentiles(asked: Iterable[float]) -> list[float]:
    """bm's standard percentiles (p50, p90, p95, p99: what ``bm compare``, its baselines and ``bm report``
    read) and the ones ``--metric-percentiles`` asks for, in order."""
    return sorted(set(PERCENTILES) | set(asked))


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
        num_expected_output_tokens=replayer.num_expected_output_tokens,
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
            "startup": startup_document(result.startup),
            "warnings": list(result.warnings),
            "config": result.config.to_dict(),
            "runtime": result.runtime,
            "parallel": parallel_info(),
            **result.metrics,
        }
    )


def startup_document(startup: dict[str, Any]) -> dict[str, Any]:
    """The start-up figures with their total (model load, engine build with its warm-up): the time a run
    spends before its clock starts, reported apart from the measured run."""
    parts = [startup.get("load_model_s"), startup.get("engine_build_s")]
    return dict(startup) | {"total_s": sum(p for p in parts if p is not None)}


def startup_line(startup: dict[str, Any]) -> str:
    """``start-up 14.2 s (model 3.1 s, engine 11.1 s: warm-up 10.7 s, 19 CUDA graphs), not measured``"""
    doc = startup_document(startup)
    parts = []
    if doc.get("load_model_s") is not None:
        parts.append(f"model {doc['load_model_s']:.1f} s")
    if doc.get("engine_build_s") is not None:
        engine = f"engine {doc['engine_build_s']:.1f} s"
        warm = doc.get("warmup")
        if warm:
            graphs = len(warm.get("graph_buckets") or [])
            engine += f": warm-up {warm['seconds']:.1f} s" + (f", {graphs} CUDA graphs" if graphs else "")
            if warm.get("touched_bytes"):  # the CPU KV pool's pages, mapped before the clock
                engine += f", {warm['touched_bytes'] / 2**20:,.0f} MB of KV mapped"
        parts.append(engine)
    return f"start-up {doc['total_s']:.1f} s ({', '.join(parts)}), before the clock"


def write_results(out_dir: Path, result: BenchResult) -> dict[str, Any]:
    """Write ``results.json`` into ``out_dir`` beside the run's ``requests.jsonl`` and ``stats.jsonl``;
    returns the results document.

    The run keeps no record: those two files are the ones its journal streamed into ``out_dir`` and put
    in order when the run ended (:class:`bm.cli.journal.FileJournal`, passed to ``run_bench`` as
    ``journal=``). ``results.json`` is written whole under a temporary name and renamed, last: its
    presence says the run finished."""
    missing = [name for name in ("requests.jsonl", "stats.jsonl") if not (out_dir / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{out_dir / missing[0]}: no such file; a run keeps no record, its journal writes them: "
            f"pass journal=FileJournal({str(out_dir)!r}) (bm.cli.journal) to run_bench"
        )
    document = results_document(result)
    with replacing_text(out_dir / "results.json") as f:
        f.write(json.dumps(document, indent=2) + "\n")
    return document


def request_line(record: dict[str, Any]) -> str:
    """One line of ``requests.jsonl``, as the final file and a journal write it."""
    return json.dumps(json_safe(record), ensure_ascii=False) + "\n"


def stats_line(row: dict[str, Any]) -> str:
    """One line of ``stats.jsonl``, as the final file and a journal write it."""
    return json.dumps(row) + "\n"


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
