"""The results of a run on disk: ``results.json``, ``requests.jsonl`` and ``stats.jsonl``.

``results.json`` says what was run (the full resolved config, bm's version, the model, the dataset, the
seed and the arrivals), then the metrics. Metric keys sit at the top level, as in ``vllm bench serve
--save-result``, so scripts written for vLLM read ``request_throughput`` or ``p99_ttft_ms`` from bm's
file unchanged.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import bm
from bm.bench.runner import BenchResult
from bm.distributed import parallel_info


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
