"""What a benchmark run keeps of its records and stats rows once they have gone to disk: enough to compute
its metrics exactly, in a few bytes per request and per iteration.

A run used to keep every per-iteration stats row as a dict (about 2.3 KB each) and every request's record
with its token gaps as Python floats, so its memory grew with its length: the whole Azure conversation
trace through the simulator (511,872 iterations) rose from 1.4 to 2.4 GB. The rows and records now
stream to a journal (:mod:`bm.bench.journal`) and only these tallies stay:

- :class:`RequestTally`, sized once for the workload: per request two flags, three int64 and four
  float64 (74 bytes), plus 8 bytes per gap between two tokens of a completed request (pooled ITL, whose
  percentiles need every value).
- :class:`StatsTally`: per iteration two float64 (16 bytes), the iteration latency and the KV
  utilization, whose means are float sums; every other figure is an integer sum or maximum.

Metrics need every value in order (a float mean is a pairwise sum: another order can change the last
bit), so the tallies keep the values in the order the in-memory frames had them and hand them to the
very functions (:func:`bm.bench.metrics.request_metrics`, :func:`~bm.bench.metrics.latency_stats`)
that compute a frame's metrics: the figures are the ones a run that kept everything reports.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import pandas as pd

from bm.bench.metrics import (
    CANCELLED,
    PERCENTILES,
    Shortfall,
    check_stats_columns,
    decoding_figures,
    no_iteration_metrics,
    request_metrics,
)

# Latencies kept per request (ms), by their record field's stem; ITL is pooled apart.
_LATENCIES = ("ttft", "tpot", "e2el", "queue_time")


def _view(values: array) -> np.ndarray:
    """A numpy view of ``values``, for numpy only: pandas objects may outlive the call (reference
    cycles), and an array whose buffer is still exported can no longer grow."""
    return np.frombuffer(values, dtype=np.float64) if len(values) else np.empty(0)


class RequestTally:
    """The numbers :func:`~bm.bench.metrics.run_metrics` and an SLO need of every request's record, in
    workload order, each request's slot filled when its record is given (:meth:`add`)."""

    def __init__(self, num_requests: int) -> None:
        n = num_requests
        self.num_requests = n
        self.num_given = 0
        self.num_cancelled = 0
        self.num_paused_requests = 0
        self.total_pauses = 0
        self._given = bytearray(n)
        self._ok = bytearray(n)
        self._input = array("q", bytes(8 * n))
        self._output = array("q", bytes(8 * n))
        self._ms = {name: array("d", [math.nan]) * n for name in _LATENCIES}
        self._itl = array("d")  # every completed request's gaps, in the order the records came
        self._itl_at = array("q", bytes(8 * n))  # where each request's gaps start in _itl, and how many
        self._itl_len = array("q", bytes(8 * n))
        self._pooled: np.ndarray | None = None  # the gaps in workload order, once the run is over
        self._shortfall = Shortfall()  # the completed requests' output lengths against those asked: sums

    def given(self, index: int) -> bool:
        return bool(self._given[index])

    def add(self, record: Mapping[str, Any]) -> None:
        """Take one request's record (a ``requests.jsonl`` row, :func:`~bm.bench.metrics.request_record`)."""
        i = record["index"]
        if self._pooled is not None:
            raise ValueError(f"request {i}: a record after the run was over")
        if self._given[i]:
            raise ValueError(f"request {i}: a second record; every request has exactly one")
        self._given[i] = 1
        self.num_given += 1
        self.num_cancelled += record["finish_reason"] == CANCELLED
        pauses = int(record["num_pauses"])
        self.num_paused_requests += pauses > 0
        self.total_pauses += pauses
        for name in _LATENCIES:
            value = record[f"{name}_ms"]
            if value is not None:
                self._ms[name][i] = value
        if not record["ok"]:
            return
        self._ok[i] = 1
        self._input[i] = record["input_tokens"]
        self._output[i] = record["output_tokens"]
        gaps = record["itl_ms"]
        self._itl_at[i] = len(self._itl)
        self._itl_len[i] = len(gaps)
        self._itl.extend(gaps)
        self._shortfall.add(
            record.get("requested_output_tokens"), record["output_tokens"], record["finish_reason"]
        )

    def _done(self) -> np.ndarray:
        return np.frombuffer(self._ok, dtype=np.bool_) if self.num_requests else np.zeros(0, dtype=bool)

    def completed(self, name: str) -> pd.Series:
        """``name``'s values (``ttft``, ``tpot``, ``itl``, ``e2el``, ``queue_time``; ms) over the completed
        requests in workload order, ITL pooled over every gap; missing values are NaN."""
        if name == "itl":
            return pd.Series(self._pooled if self._pooled is not None else self._gaps(), copy=False)
        return pd.Series(_view(self._ms[name])[self._done()], copy=False)  # a mask's result is a copy

    def _gaps(self) -> np.ndarray:
        """The completed requests' gaps, pooled in workload order (a new array)."""
        rows = np.flatnonzero(self._done())
        gaps = _view(self._itl)
        starts, lens = np.asarray(self._itl_at)[rows], np.asarray(self._itl_len)[rows]
        pieces = [gaps[a : a + n] for a, n in zip(starts.tolist(), lens.tolist(), strict=True)]
        return np.concatenate(pieces) if pieces else np.empty(0)

    def close(self) -> None:
        """The run is over: the gaps are put in workload order once and the arrival order let go (the
        metrics' peak memory holds one copy of them, not two). No record may come after."""
        if self._pooled is None:
            self._pooled = self._gaps()
            self._itl = array("d")

    def metrics(
        self,
        duration_s: float,
        slo_ms: Mapping[str, float | None] | None = None,
        percentiles: Iterable[float] = PERCENTILES,
    ) -> dict[str, Any]:
        """:func:`~bm.bench.metrics.run_metrics` of the records given, with ``percentiles`` of each latency."""
        done = self._done()
        frame = pd.DataFrame(
            {
                "input_tokens": np.asarray(self._input, dtype=np.int64)[done],
                "output_tokens": np.asarray(self._output, dtype=np.int64)[done],
                **{f"{name}_ms": self.completed(name).to_numpy() for name in _LATENCIES},
            }
        )
        metrics = request_metrics(
            frame,
            self.completed("itl"),
            self.num_requests,
            self.num_cancelled,
            duration_s,
            slo_ms,
            percentiles,
        )
        return metrics | self._shortfall.figures()

    def nbytes(self) -> int:
        """The bytes its arrays hold (a memory check's figure)."""
        arrays: Iterable[Any] = (
            self._given, self._ok, self._input, self._output, self._itl, self._itl_at, self._itl_len,
            *self._ms.values(),
        )  # fmt: skip
        pooled = 0 if self._pooled is None else self._pooled.nbytes
        return pooled + sum(len(a) * getattr(a, "itemsize", 1) for a in arrays)


# Fields summed over the iterations (engine_metrics' totals and means of integer fields).
_SUMMED = (
    "Scheduled Requests",
    "Total Context Tokens",
    "Total Generation Tokens",
    "Computed Tokens",
    "Padded Context Tokens",
    "Empty Generation Slots",
    "Used KV cache blocks",
    "Draft Steps",
    "Draft Tokens",
    "Accepted Draft Tokens",
)


class StatsTally:
    """The numbers :func:`~bm.bench.metrics.engine_metrics` and ``bm compare``'s block counters need of
    a run's per-iteration stats rows, given one by one in iteration order (:meth:`add`)."""

    def __init__(self) -> None:
        self.num_iterations = 0
        self.sums = dict.fromkeys(_SUMMED, 0)
        self.max_paused = 0
        self.max_used_blocks = 0
        self.fields: set[str] = set()  # every field any row had
        self._latency = array("d")
        self._utilization = array("d")  # used / max blocks, NaN where the cache had no block

    def add(self, row: Mapping[str, Any]) -> None:
        self.num_iterations += 1
        self.fields.update(row)
        sums = self.sums
        for key in _SUMMED:
            sums[key] += row.get(key, 0)
        self.max_paused = max(self.max_paused, row.get("Paused Requests", 0))
        used, blocks = row.get("Used KV cache blocks"), row.get("Max KV cache blocks")
        if used is not None:
            self.max_used_blocks = max(self.max_used_blocks, int(used))
        # float division of the same two numbers as pandas' used / max.where(max > 0)
        fits = used is not None and blocks is not None and blocks > 0
        self._utilization.append(used / blocks if fits else math.nan)
        latency = row.get("Iteration Latency (ms)")
        self._latency.append(math.nan if latency is None else latency)

    def metrics(self, num_paused_requests: int, total_pauses: int) -> dict[str, Any]:
        """:func:`~bm.bench.metrics.engine_metrics` of the rows given, with the requests' pauses."""
        n = self.num_iterations
        out: dict[str, Any] = {
            "num_iterations": n,
            "num_paused_requests": num_paused_requests,
            "total_pauses": total_pauses,
        }
        if not n:
            return out | no_iteration_metrics()
        check_stats_columns(sorted(self.fields))
        s = self.sums
        utilization = pd.Series(_view(self._utilization).copy())
        return out | {
            "total_computed_tokens": s["Computed Tokens"],
            "total_padded_context_tokens": s["Padded Context Tokens"],
            "total_empty_generation_slots": s["Empty Generation Slots"],
            # integer sums are exact in float64, so these equal pandas' float64 sum over the count
            "mean_requests_per_iteration": s["Scheduled Requests"] / n,
            "mean_tokens_per_iteration": (s["Total Context Tokens"] + s["Total Generation Tokens"]) / n,
            "mean_computed_tokens_per_iteration": s["Computed Tokens"] / n,
            "mean_kv_cache_utilization": float(utilization.mean()),
            "max_kv_cache_utilization": float(utilization.max()),
            "mean_iteration_latency_ms": float(pd.Series(_view(self._latency).copy()).mean()),
            "max_paused_per_iteration": int(self.max_paused),
            **decoding_figures(s["Draft Steps"], s["Draft Tokens"], s["Accepted Draft Tokens"]),
        }

    def kv_block_counters(self) -> dict[str, int]:
        """The KV blocks the run held: the peak, and the sum over iterations (block-iterations)."""
        return {
            "max_used_kv_blocks": self.max_used_blocks,
            "total_used_kv_block_iterations": self.sums["Used KV cache blocks"],
        }

    def nbytes(self) -> int:
        return (len(self._latency) + len(self._utilization)) * 8
