"""Benchmark workloads: dataset loaders and arrival processes (plain Python, pandas and datasets; no torch).

``load_workload(bench_config, vocab_size=..., encode=...)`` reads any supported dataset into
:class:`Workload` (one :class:`Row` per row, the type ``bm run`` reads too, bad rows kept with their error);
:class:`ArrivalPlan` turns the bench config into arrival times.

The names are imported lazily: ``bm.workloads.jsonl`` (the request-file parser every command uses before
anything else) must not pay for pandas and numpy, which the loaders and arrival processes need.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "ArrivalPlan": "bm.workloads.arrivals",
    "arrival_times": "bm.workloads.arrivals",
    "gamma_arrivals": "bm.workloads.arrivals",
    "offline_arrivals": "bm.workloads.arrivals",
    "poisson_arrivals": "bm.workloads.arrivals",
    "trace_arrivals": "bm.workloads.arrivals",
    "LOADERS": "bm.workloads.load",
    "detect_kind": "bm.workloads.load",
    "load_workload": "bm.workloads.load",
    "read_workload": "bm.workloads.load",
    "DatasetError": "bm.workloads.request",
    "Workload": "bm.workloads.request",
    "Row": "bm.workloads.request",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'bm.workloads' has no attribute {name!r}")
    return getattr(import_module(module), name)
