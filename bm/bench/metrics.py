"""Benchmark metrics with the names and formulas of ``vllm bench serve``, computed with pandas.

Per request (all latencies from the request's send time, in ms):

- TTFT: first token - send; E2EL: last token - send;
- TPOT: (E2EL - TTFT) / (output tokens - 1), undefined for one-token outputs (left out of TPOT
  statistics; for goodput such a request meets any TPOT SLO, as in vLLM);
- ITL: every gap between consecutive tokens, pooled over all requests;
- queue time: send -> first scheduled iteration (waiting for the batch manager to take the request,
  plus the final response's ``queue_time``).

Per run: ``duration`` runs from the replay's start to the last final response; throughputs count
completed requests only; ``request_goodput`` is completed requests meeting every given SLO per second.
Statistics: mean, median, std (population, ``ddof=0``, as ``numpy.std`` in vLLM), p50/p90/p95/p99
(linear interpolation, as ``numpy.percentile``). A statistic over no values is ``null``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import pandas as pd

from bm.bench.replayer import Timeline
from bm.scheduling import FinishReason
from bm.workloads.request import Row

PERCENTILES = (50, 90, 95, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2el", "queue_time")
OK_REASONS = ("length", "stop")
SLO_METRICS = ("ttft", "tpot", "e2el")

CANCELLED = FinishReason.CANCELLED.label


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


RECORD_COLUMNS = (
    "index",
    "id",
    "ok",
    "finish_reason",
    "error",
    "input_tokens",
    "output_tokens",
    "requested_output_tokens",
    "arrival_s",
    "send_s",
    "queue_time_ms",
    "ttft_ms",
    "tpot_ms",
    "e2el_ms",
    "itl_ms",
    "num_pauses",
    "paused",
)


def request_record(index: int, req: Row, timeline: Timeline | None) -> dict[str, Any]:
    """One row of requests.jsonl: what happened to a request, with its latencies in ms."""
    record: dict[str, Any] = {
        "index": index,
        "id": req.user_id,
        "ok": False,
        "finish_reason": "error",
        "error": req.error,
        "input_tokens": req.input_len if req.input_ids is None else len(req.input_ids),
        "output_tokens": 0,
        "requested_output_tokens": req.max_tokens,  # the length its row asked for
        "arrival_s": None,
        "send_s": None,
        "queue_time_ms": None,
        "ttft_ms": None,
        "tpot_ms": None,
        "e2el_ms": None,
        "itl_ms": [],
        "num_pauses": 0,
        "paused": False,
    }
    if timeline is None:
        return record
    tokens = timeline.token_s
    ok = timeline.error is None and timeline.finish_reason in OK_REASONS and bool(tokens)
    record.update(
        ok=ok,
        finish_reason=timeline.finish_reason,
        error=timeline.error,
        output_tokens=len(tokens),
        arrival_s=timeline.arrival_s,
        send_s=timeline.send_s,
        num_pauses=timeline.num_pauses,
        paused=timeline.num_pauses > 0,
    )
    if timeline.send_s is not None and timeline.taken_s is not None and timeline.engine_queue_s is not None:
        record["queue_time_ms"] = _ms(timeline.taken_s - timeline.send_s + timeline.engine_queue_s)
    if ok and timeline.send_s is not None:
        ttft = tokens[0] - timeline.send_s
        e2el = tokens[-1] - timeline.send_s
        record.update(
            ttft_ms=_ms(ttft),
            e2el_ms=_ms(e2el),
            tpot_ms=_ms((e2el - ttft) / (len(tokens) - 1)) if len(tokens) > 1 else None,
            itl_ms=[_ms(b - a) for a, b in itertools.pairwise(tokens)],
        )
    return record


def latency_stats(
    values: pd.Series, name: str, percentiles: Iterable[float] = PERCENTILES
) -> dict[str, float | None]:
    """mean/median/std/pNN of ``values`` (ms) under vLLM's key names, e.g. ``p99_ttft_ms`` (``p99.9`` for a
    fractional percentile, as vLLM names it)."""
    if values.dtype != np.float64:  # numbers already (a long pooled ITL column): not copied again
        values = pd.to_numeric(values, errors="coerce")
    values = values.dropna()
    empty = values.empty

    def value(x: float) -> float | None:
        return None if empty or math.isnan(x) else float(x)

    out = {
        f"mean_{name}_ms": value(values.mean()) if not empty else None,
        f"median_{name}_ms": value(values.median()) if not empty else None,
        f"std_{name}_ms": value(values.std(ddof=0)) if not empty else None,
    }
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = value(values.quantile(p / 100)) if not empty else None
    return out


def run_metrics(
    records: pd.DataFrame, duration_s: float, slo_ms: Mapping[str, float | None] | None = None
) -> dict[str, Any]:
    """Counts, throughputs, goodput and latency statistics of one run (one row per request)."""
    done = records[records["ok"].astype(bool)] if len(records) else records
    # cut off by an interrupt (never sent, or stopped mid-way): neither completed nor failed
    cancelled = int((records["finish_reason"] == CANCELLED).sum()) if "finish_reason" in records else 0
    itl = done["itl_ms"].explode() if len(done) else pd.Series(dtype=float)
    metrics = request_metrics(done, itl, len(records), cancelled, duration_s, slo_ms)
    asked = done["requested_output_tokens"] if "requested_output_tokens" in done else [None] * len(done)
    reasons = done["finish_reason"] if "finish_reason" in done else [None] * len(done)
    return metrics | shortfall_figures(zip(asked, done["output_tokens"], reasons, strict=True))


class Shortfall:
    """The completed requests' output lengths against what their rows asked, summed as records come (a
    few integers, whatever the run's length): a request that ended at the model's end token
    (``--respect-eos``) or a stop word falls short, and the run says by how much rather than reporting
    throughput over lengths nobody chose. A request whose row gives no length asks for nothing."""

    def __init__(self) -> None:
        self.asked = self.short = self.num_short = 0
        self.reasons: dict[str, int] = {}

    def add(self, asked: Any, produced: int, reason: str) -> None:
        if asked is None or asked != asked:  # None, or NaN in a frame
            return
        asked, produced = int(asked), int(produced)
        self.asked += asked
        if produced < asked:
            self.short += asked - produced
            self.num_short += 1
            self.reasons[reason] = self.reasons.get(reason, 0) + 1

    def figures(self) -> dict[str, Any]:
        return {
            "requested_output_tokens": self.asked,
            "output_tokens_short": self.short,
            "num_requests_short": self.num_short,
            "short_finish_reasons": dict(sorted(self.reasons.items())),
        }


def shortfall_figures(requests: Iterable[tuple[Any, int, str]]) -> dict[str, Any]:
    """:class:`Shortfall` of (asked, produced, finish reason) per completed request."""
    sums = Shortfall()
    for asked, produced, reason in requests:
        sums.add(asked, produced, reason)
    return sums.figures()


def request_metrics(
    done: pd.DataFrame,
    itl: pd.Series,
    num_requests: int,
    num_cancelled: int,
    duration_s: float,
    slo_ms: Mapping[str, float | None] | None = None,
    percentiles: Iterable[float] = PERCENTILES,
) -> dict[str, Any]:
    """:func:`run_metrics` from its parts: ``done``, the completed requests in workload order (columns
    ``input_tokens``, ``output_tokens`` and ``NAME_ms`` for every latency but ITL), and ``itl``, their
    token gaps pooled in the same order. A streamed run (:mod:`bm.bench.tally`) keeps only these, and
    gets the very statistics of the same values."""
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    input_tokens = int(done["input_tokens"].sum()) if len(done) else 0
    output_tokens = int(done["output_tokens"].sum()) if len(done) else 0
    metrics: dict[str, Any] = {
        "duration": duration_s,
        "num_requests": num_requests,
        "completed": len(done),
        "failed": num_requests - len(done) - num_cancelled,
        "cancelled": num_cancelled,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": per_s(len(done)),
        "request_goodput": per_s(_num_good(done, slo_ms)) if slo_ms and any(slo_ms.values()) else None,
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(input_tokens + output_tokens),
    }
    empty = pd.Series(dtype=float)
    for name in LATENCIES:
        column = itl if name == "itl" else done[f"{name}_ms"] if len(done) else empty
        metrics.update(latency_stats(column, name, percentiles))
    return metrics


def _num_good(done: pd.DataFrame, slo_ms: Mapping[str, float | None]) -> int:
    if not len(done):
        return 0
    good = pd.Series(True, index=done.index)
    for name in SLO_METRICS:
        limit = slo_ms.get(name)
        if limit is None:
            continue
        values = pd.to_numeric(done[f"{name}_ms"], errors="coerce")
        if name == "tpot":
            values = values.fillna(0.0)  # one-token outputs have no TPOT: they meet it (vLLM)
        good &= values <= limit
    return int(good.sum())


ENGINE_KEYS = (
    "mean_requests_per_iteration",
    "mean_tokens_per_iteration",
    "mean_computed_tokens_per_iteration",
    "mean_kv_cache_utilization",
    "max_kv_cache_utilization",
    "mean_iteration_latency_ms",
    "max_paused_per_iteration",
)
ENGINE_TOTALS = ("total_computed_tokens", "total_padded_context_tokens", "total_empty_generation_slots")


# Every per-iteration stats field engine_metrics reads, spelled as bm.engine.outputs.stats writes them.
STATS_COLUMNS = (
    "Scheduled Requests",
    "Total Context Tokens",
    "Total Generation Tokens",
    "Computed Tokens",
    "Padded Context Tokens",
    "Empty Generation Slots",
    "Max KV cache blocks",
    "Used KV cache blocks",
    "Iteration Latency (ms)",
    "Paused Requests",
    "Draft Steps",
    "Draft Tokens",
    "Accepted Draft Tokens",
)


class MissingStatsColumnError(KeyError):
    """Per-iteration stats lack a field a metric is computed from.

    Raised rather than counting the field as 0: a renamed or misspelt field would otherwise report a
    plausible zero (no padding, no empty slots) instead of the truth.
    """

    def __str__(self) -> str:
        return str(self.args[0])


def engine_metrics(stats: pd.DataFrame, records: pd.DataFrame) -> dict[str, Any]:
    """The batch manager's side, from the per-iteration stats: iterations, batch sizes, KV use, pauses.

    KV utilization is used blocks / max blocks per iteration (taken after allocation, so it is the
    iteration's peak). Tokens per iteration counts real context and generation tokens; computed tokens
    adds what a scheme pays for nothing (V1's padding and empty generation slots). A run of no iterations
    has no fields at all and gives zero totals; any other run must have every field in
    :data:`STATS_COLUMNS`, else :class:`MissingStatsColumnError`."""
    paused = records["num_pauses"].astype(int) if len(records) else pd.Series(dtype=int)
    out: dict[str, Any] = {
        "num_iterations": len(stats),
        "num_paused_requests": int((paused > 0).sum()),
        "total_pauses": int(paused.sum()),
    }
    if not len(stats):
        return out | no_iteration_metrics()
    check_stats_columns(stats.columns)
    max_blocks = stats["Max KV cache blocks"]
    utilization = stats["Used KV cache blocks"] / max_blocks.where(max_blocks > 0)
    tokens = stats["Total Context Tokens"] + stats["Total Generation Tokens"]
    return out | {
        "total_computed_tokens": int(stats["Computed Tokens"].sum()),
        "total_padded_context_tokens": int(stats["Padded Context Tokens"].sum()),
        "total_empty_generation_slots": int(stats["Empty Generation Slots"].sum()),
        "mean_requests_per_iteration": float(stats["Scheduled Requests"].mean()),
        "mean_tokens_per_iteration": float(tokens.mean()),
        "mean_computed_tokens_per_iteration": float(stats["Computed Tokens"].mean()),
        "mean_kv_cache_utilization": float(utilization.mean()),
        "max_kv_cache_utilization": float(utilization.max()),
        "mean_iteration_latency_ms": float(stats["Iteration Latency (ms)"].mean()),
        "max_paused_per_iteration": int(stats["Paused Requests"].max()),
        **decoding_metrics(stats),
    }


def no_iteration_metrics() -> dict[str, Any]:
    """The engine figures of a run that ran no iteration: zero totals, no means."""
    return dict.fromkeys(ENGINE_TOTALS, 0) | decoding_figures(0, 0, 0) | dict.fromkeys(ENGINE_KEYS)


def check_stats_columns(present: Iterable[str]) -> None:
    """Raise :class:`MissingStatsColumnError` naming every field of :data:`STATS_COLUMNS` not in
    ``present`` (the fields of a run's stats rows)."""
    present = list(present)
    missing = [c for c in STATS_COLUMNS if c not in present]
    if missing:
        raise MissingStatsColumnError(
            f"the per-iteration stats have no field {', '.join(map(repr, missing))} "
            f"(fields present: {', '.join(map(repr, present))}); they must come from the same bm "
            "version as these metrics: re-run the benchmark to regenerate stats.jsonl"
        )


def decoding_metrics(stats: pd.DataFrame) -> dict[str, Any]:
    """Draft tokens (speculative decoding), as trtllm-bench's decoding stats (:func:`decoding_figures`)."""
    return decoding_figures(
        _total(stats, "Draft Steps"), _total(stats, "Draft Tokens"), _total(stats, "Accepted Draft Tokens")
    )


def decoding_figures(steps: int, drafted: int, accepted: int) -> dict[str, Any]:
    """The acceptance length is the tokens a verifying step produced on average (accepted drafts plus
    the model's own), 1 without drafts."""
    return {
        "total_draft_tokens": drafted,
        "total_accepted_draft_tokens": accepted,
        "draft_acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": (accepted + steps) / steps if steps else None,
    }


def _total(stats: pd.DataFrame, column: str) -> int:
    return int(stats[column].sum()) if len(stats) else 0
