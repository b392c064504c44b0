"""Benchmark workloads: dataset loaders and arrival processes (plain Python, pandas and datasets; no torch).

``load_workload(bench_config, vocab_size=..., encode=...)`` reads any supported dataset into
:class:`Workload` (one :class:`WorkloadRequest` per row, bad rows kept with their error);
:class:`ArrivalPlan` turns the bench config into arrival times.
"""

from bm.workloads.arrivals import (
    ArrivalPlan,
    arrival_times,
    gamma_arrivals,
    offline_arrivals,
    poisson_arrivals,
    trace_arrivals,
)
from bm.workloads.load import LOADERS, detect_kind, load_workload, read_workload
from bm.workloads.request import DatasetError, Workload, WorkloadRequest

__all__ = [
    "LOADERS",
    "ArrivalPlan",
    "DatasetError",
    "Workload",
    "WorkloadRequest",
    "arrival_times",
    "detect_kind",
    "gamma_arrivals",
    "load_workload",
    "offline_arrivals",
    "poisson_arrivals",
    "read_workload",
    "trace_arrivals",
]
