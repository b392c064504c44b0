"""Arrival processes: when each request of a workload reaches the batch manager's queue.

Times are seconds after the replay starts; the first request always arrives at 0.

- offline: every request at 0 (a throughput run, like ``trtllm-bench throughput``);
- trace: the dataset's own timestamps times ``time_scale`` (0.5 replays twice as fast);
- poisson: exponential gaps at ``rate`` requests/s;
- gamma: gaps drawn from Gamma(shape=burstiness, scale=1/(rate*burstiness)), as ``vllm bench serve``
  does: the mean rate stays ``rate``, burstiness < 1 clusters arrivals, > 1 spaces them evenly.

A concurrency cap is not an arrival process: the replayer enforces it (a request whose time has come
waits for a free slot).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bm.config import BenchConfig
from bm.workloads.request import Workload


def offline_arrivals(count: int) -> list[float]:
    return [0.0] * count


def trace_arrivals(timestamps: Sequence[float], time_scale: float = 1.0) -> list[float]:
    """Scaled gaps of a trace, starting at 0; the order is the trace's (checked by the loaders)."""
    if not timestamps:
        return []
    first = timestamps[0]
    return [(t - first) * time_scale for t in timestamps]


def gamma_arrivals(count: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Cumulative gamma gaps (burstiness 1 is a Poisson process), the first request at 0."""
    if count <= 0:
        return []
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"rate and burstiness must be > 0, got {rate} and {burstiness}")
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=count - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def poisson_arrivals(count: int, rate: float, seed: int = 0) -> list[float]:
    return gamma_arrivals(count, rate, 1.0, seed)


@dataclass(frozen=True)
class ArrivalPlan:
    """What the bench config asks for, in words for the results file."""

    process: str  # offline | trace | poisson | gamma
    request_rate: float | None = None
    burstiness: float | None = None
    time_scale: float | None = None

    @classmethod
    def from_config(cls, bench: BenchConfig) -> ArrivalPlan:
        if bench.trace_timestamps:
            return cls("trace", time_scale=bench.time_scale)
        if bench.request_rate is not None:
            process = "poisson" if bench.burstiness == 1.0 else "gamma"
            return cls(process, request_rate=bench.request_rate, burstiness=bench.burstiness)
        return cls("offline")

    def times(self, count: int, timestamps: Sequence[float | None] = (), seed: int = 0) -> list[float]:
        if self.process == "trace":
            if len(timestamps) != count or any(t is None for t in timestamps):
                raise ValueError("trace arrivals need one timestamp per request")
            return trace_arrivals([float(t) for t in timestamps], self.time_scale or 1.0)  # type: ignore[arg-type]
        if self.process in ("poisson", "gamma"):
            return gamma_arrivals(count, self.request_rate or 0.0, self.burstiness or 1.0, seed)
        return offline_arrivals(count)

    def describe(self) -> dict[str, object]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def arrival_times(workload: Workload, bench: BenchConfig) -> list[float]:
    """One arrival time per row of ``workload`` (rows that cannot run keep a place but are never sent).

    A failed row may lack a timestamp (a malformed line); it takes its predecessor's, so the times of
    the rows around it are the trace's own."""
    plan = ArrivalPlan.from_config(bench)
    stamps: list[float | None] = []
    if plan.process == "trace":
        previous = 0.0
        for req in workload.requests:
            previous = req.arrival_time if req.arrival_time is not None else previous
            stamps.append(previous)
    return plan.times(len(workload.requests), stamps, seed=bench.seed)
