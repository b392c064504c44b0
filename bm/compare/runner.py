"""``bm compare``'s library side: variants, interleaved repeats, summaries, ratios and compare.json's
content (bm.compare.render draws the table and writes the files).

Every variant runs in one process on one loaded model, on the identical workload and arrival times.
Repeats are interleaved (v1, inflight, ..., v1, inflight, ...) rather than run back to back, so a slow
stretch of the machine (another job, thermal throttling) spreads over all variants instead of landing on
one. Each figure reported is the median over repeats; the spread of output throughput is kept. A paired
gate (``--baseline-cmd``) puts a run of the baseline's code beside each run of this code
(bm.compare.paired).

The reference baselines (``hf-generate``, ``hf-cb``) are run on the same model weights and the same
requests. They have no notion of arrival times: they always run offline (everything at t=0), to each
request's full output length, and report throughput only, since neither exposes per-token timing.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import bm
from bm.baselines import run_hf_continuous_batching, run_hf_generate
from bm.bench import BenchResult, run_bench
from bm.bench.journal import BenchJournal
from bm.bench.results import json_safe
from bm.compare.expr import AssertionOutcome
from bm.compare.load import BACKGROUND_SHARE
from bm.compare.pairing import PairingError
from bm.compare.regress import (
    EXACT_IF_OFFLINE,
    TIMING_METRICS,
    Regression,
    TimingCheck,
    kv_block_counters,
    summarize_timing,
)
from bm.compare.variants import Variant, variant_config
from bm.config import BmConfig, ConfigError
from bm.cpu_load import background_share, read_ticks
from bm.runtime import LoadedModel
from bm.runtime.native import runtime_info
from bm.workloads import Workload

# Columns of the table (key in the summary, header); the ratio column is added after them.
TABLE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("output_throughput", "out tok/s"),
    ("request_throughput", "req/s"),
    ("median_ttft_ms", "TTFT p50"),
    ("p99_ttft_ms", "TTFT p99"),
    ("median_tpot_ms", "TPOT p50"),
    ("p99_tpot_ms", "TPOT p99"),
    ("median_e2el_ms", "E2EL p50"),
    ("p99_e2el_ms", "E2EL p99"),
    ("mean_kv_cache_utilization", "KV util"),
    ("total_empty_generation_slots", "empty gen slots"),
    ("num_iterations", "iterations"),
    ("total_computed_tokens", "token-slots computed"),
)
# Ratios to the reference variant, for the figures where a ratio reads naturally.
RATIO_METRICS = (
    "output_throughput",
    "request_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_e2el_ms",
    "p99_e2el_ms",
    "total_computed_tokens",
)


@dataclass
class VariantOutcome:
    variant: Variant
    repeats: list[dict[str, Any]] = field(default_factory=list)  # metrics of each repeat
    # A paired gate's other half: the metrics of the baseline's code, one per repeat (bm.compare.paired)
    paired: list[dict[str, Any]] = field(default_factory=list)
    last: BenchResult | None = None  # the last repeat, for its results.json beside its journal's files

    def summary(self) -> dict[str, Any]:
        """Median over repeats of every numeric metric; other values from the last repeat."""
        if not self.repeats:
            return {}
        out: dict[str, Any] = {}
        for key in self.repeats[-1]:
            values = [r.get(key) for r in self.repeats]
            numbers = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
            if numbers and len(numbers) == len(values):
                median = statistics.median(numbers)
                out[key] = (
                    int(median)
                    if all(isinstance(v, int) for v in numbers) and median == int(median)
                    else median
                )
            else:
                out[key] = values[-1]
        return out

    def timings(self) -> dict[str, dict[str, Any]]:
        """Each timing metric's best repeat, median, range and spread: what a later ``--baseline``
        judges this run by."""
        out = {}
        shares = [r.get(BACKGROUND_SHARE) for r in self.repeats]
        for metric in TIMING_METRICS:
            summary = summarize_timing(metric, [r.get(metric) for r in self.repeats], shares)
            if summary is not None:
                out[metric] = summary.to_dict()
        return out

    def unstable_counters(self, offline_arrivals: bool) -> list[str]:
        """Counters that differed between repeats; none are expected to match under timed arrivals."""
        if not offline_arrivals:
            return []
        return [key for key in EXACT_IF_OFFLINE if len({r.get(key) for r in self.repeats}) > 1]


@dataclass
class CompareResult:
    variants: list[VariantOutcome]
    reference: str
    offline_arrivals: bool
    config: BmConfig
    model_name: str
    workload: dict[str, Any]
    repeat: int
    runtime: dict[str, Any] = field(default_factory=dict)  # bm.runtime.native.runtime_info()
    assertions: list[AssertionOutcome] = field(default_factory=list)
    regressions: list[Regression] = field(default_factory=list)
    baseline_path: str | None = None
    tolerance: float | None = None
    noise_factor: float | None = None
    timing_checks: list[TimingCheck] = field(default_factory=list)
    interrupted: bool = False  # a signal ended it: ``repeat`` rounds finished, none judged
    timed_out: bool = False  # the deadline came: the round it cut short was dropped
    identity: dict[str, Any] | None = None  # what a later --baseline must share (bm.compare.identity)
    # How the gate's timings were judged: "paired" (with the command), "saved", or "simulated"; and why
    # a gate that was asked to pair did not.
    timings_from: str | None = None
    baseline_command: str | None = None
    pairing_error: str | None = None
    elapsed_s: float | None = None  # measuring time, first run to last

    def metrics(self) -> dict[str, dict[str, Any]]:
        """``{variant: summary}``: what --assert expressions and --baseline checks read."""
        return {v.variant.name: v.summary() for v in self.variants}

    def ratios(self) -> dict[str, dict[str, float | None]]:
        table = self.metrics()
        ref = table.get(self.reference, {})
        out: dict[str, dict[str, float | None]] = {}
        for name, row in table.items():
            out[name] = {}
            for key in RATIO_METRICS:
                a, b = row.get(key), ref.get(key)
                ok = isinstance(a, int | float) and isinstance(b, int | float) and b
                out[name][key] = a / b if ok else None
        return out


def _baseline_metrics(
    name: str, loaded: LoadedModel, workload: Workload, hf_batch_size: int, stop: threading.Event | None
) -> dict[str, Any]:
    runnable = [(r.input_ids, r.max_tokens) for r in workload.requests if r.ok and r.input_ids is not None]
    if name == "hf-generate":
        peer = run_hf_generate(loaded.model, runnable, batch_size=hf_batch_size, stop=stop)
    else:
        peer = run_hf_continuous_batching(loaded.model, runnable, stop=stop)
    wall = peer.wall_s
    metrics: dict[str, Any] = {
        "duration": wall,
        "num_requests": len(workload.requests),
        "completed": len(runnable),
        "failed": len(workload.requests) - len(runnable),
        "total_input_tokens": peer.num_prompt_tokens,
        "total_output_tokens": peer.num_output_tokens,
        "request_throughput": len(runnable) / wall if wall > 0 else 0.0,
        "output_throughput": peer.output_tok_s,
        "total_token_throughput": peer.total_tok_s,
    }
    for key, _ in TABLE_COLUMNS:
        metrics.setdefault(key, None)
    return metrics


RunCallback = Callable[[Variant, int, dict[str, Any]], None]
# A journal for one run of a bm variant (see bm.bench.journal), entered for that run and left after it.
JournalFactory = Callable[[Variant], AbstractContextManager[BenchJournal]]
# Runs a variant on the baseline's code (bm.compare.pairing.BaselineWorker.run): its metrics.
PairedRun = Callable[[Variant], dict[str, Any]]


def run_variant(
    config: BmConfig,
    loaded: LoadedModel,
    workload: Workload,
    arrivals: Sequence[float],
    variant: Variant,
    *,
    hf_batch_size: int = 16,
    journal: JournalFactory | None = None,
    stop: threading.Event | None = None,
) -> tuple[dict[str, Any], BenchResult | None]:
    """One run of one variant (``config`` already the variant's): its metrics, with the share of the
    CPU other processes took meanwhile (none under the simulator, whose clock no load moves), and the
    bench result of a bm variant. A paired gate's worker runs its side through this too."""
    simulated = config.engine.executor == "sim"
    before = None if simulated else read_ticks()
    run: BenchResult | None = None
    if variant.kind == "bm":
        with journal(variant) if journal is not None else nullcontext() as run_journal:
            run = run_bench(config, loaded, workload, arrivals, journal=run_journal, stop=stop)
        metrics = dict(run.metrics) | kv_block_counters(run.iterations)
    else:
        metrics = _baseline_metrics(variant.name, loaded, workload, hf_batch_size, stop)
    metrics[BACKGROUND_SHARE] = None if simulated else background_share(before, read_ticks())
    return metrics, run


def run_compare(
    config: BmConfig,
    loaded: LoadedModel,
    workload: Workload,
    arrivals: Sequence[float],
    variants: Sequence[Variant],
    *,
    repeat: int = 1,
    reference: str | None = None,
    hf_batch_size: int = 16,
    on_start: RunCallback | None = None,
    on_done: RunCallback | None = None,
    journal: JournalFactory | None = None,
    more_rounds: Callable[[CompareResult], int] | None = None,
    stop: threading.Event | None = None,
    paired: PairedRun | None = None,
    deadline: float | None = None,
) -> CompareResult:
    """Run ``repeat`` interleaved rounds of every variant and collect their metrics.

    ``stop`` (the command's first signal): the run in progress is cut short, no other starts, and the
    round it was in is dropped, so every variant keeps the same finished rounds (none, when the first
    was cut short); the result says ``interrupted``.

    ``more_rounds``: asked after the rounds run so far, how many more to run (0: done); the baseline gate
    uses it to re-measure before it calls a timing a regression, or when the machine was too noisy to
    judge.

    ``paired``: runs a variant on the baseline's code; each run of this code is then paired with one of
    the baseline's, back to back, the baseline's first in even rounds and second in odd ones, kept in
    :attr:`VariantOutcome.paired`. When it raises :class:`~bm.compare.pairing.PairingError` the pairs so
    far are dropped and the comparison goes on unpaired (``pairing_error`` says why).

    ``deadline`` (``time.monotonic()``): no run starts after it; the round it interrupts is dropped and
    the result says ``timed_out``.

    ``journal``: called before each run of a bm variant for the journal that receives that run's stats
    rows and records as they come (``bm compare`` streams them into the variant's folder, each repeat
    starting it afresh, so a killed comparison leaves the runs it was in)."""
    if repeat < 1:
        raise ConfigError(f"--repeat {repeat}: must be at least 1")
    if not variants:
        raise ConfigError("nothing to compare: give --schemes and/or --baselines")
    names = [v.name for v in variants]
    reference = reference or ("v1" if "v1" in names else names[0])
    if reference not in names:
        raise ConfigError(f"--reference {reference!r}: not one of the variants ({', '.join(names)})")
    if config.engine.executor == "sim" and any(v.kind != "bm" for v in variants):
        raise ConfigError(
            "--baselines run the model itself and cannot be simulated; drop them with --executor sim"
        )
    configs = {v.name: variant_config(config, v) for v in variants if v.kind == "bm"}
    outcomes = [VariantOutcome(v) for v in variants]
    offline = bool(arrivals) and all(t == 0 for t in arrivals) and config.bench.max_concurrency is None
    result = CompareResult(
        variants=outcomes,
        reference=reference,
        offline_arrivals=offline,
        config=config,
        model_name=loaded.name,
        workload=workload.describe(),
        repeat=0,
        runtime=loaded.runtime()
        if config.engine.executor == "sim"
        else runtime_info(loaded.device, loaded.dtype, loaded.quantization),
    )
    started = time.monotonic()

    def ours(outcome: VariantOutcome, round_index: int) -> None:
        v = outcome.variant
        if on_start:
            on_start(v, round_index, {})
        metrics, run = run_variant(
            configs.get(v.name, config), loaded, workload, arrivals, v,
            hf_batch_size=hf_batch_size, journal=journal, stop=stop,
        )  # fmt: skip
        outcome.last = run or outcome.last
        outcome.repeats.append(metrics)
        if on_done:
            on_done(v, round_index, metrics)

    def theirs(outcome: VariantOutcome) -> None:
        nonlocal paired
        if paired is None:
            return
        try:
            outcome.paired.append(paired(outcome.variant))
        except PairingError as exc:
            result.pairing_error = str(exc)
            paired = None
            for each in outcomes:
                each.paired.clear()

    def halted() -> bool:
        if stop is not None and stop.is_set():
            result.interrupted = True
        elif deadline is not None and time.monotonic() >= deadline:
            result.timed_out = True
        return result.interrupted or result.timed_out

    rounds = repeat
    while rounds > 0:
        for _ in range(rounds):
            round_index, cut = result.repeat, False
            for outcome in outcomes:
                sides = ("theirs", "ours") if round_index % 2 == 0 else ("ours", "theirs")
                for side in sides if paired is not None else ("ours",):
                    cut = cut or halted()
                    if cut:
                        break
                    if side == "ours":
                        ours(outcome, round_index)
                    else:
                        theirs(outcome)
            if stop is not None and stop.is_set():  # its last run may have been cut short too
                result.interrupted = cut = True
            if cut:
                for outcome in outcomes:  # the round cut short: its figures are partial
                    del outcome.repeats[result.repeat :]
                    del outcome.paired[result.repeat :]
                result.elapsed_s = time.monotonic() - started
                return result
            result.repeat += 1
        rounds = more_rounds(result) if more_rounds is not None else 0
    result.elapsed_s = time.monotonic() - started
    return result


def compare_document(result: CompareResult) -> dict[str, Any]:
    """The content of compare.json."""
    ratios = result.ratios()
    variants = {}
    for outcome in result.variants:
        v = outcome.variant
        throughputs = [r.get("output_throughput") for r in outcome.repeats]
        variants[v.name] = {
            "kind": v.kind,
            "batching_scheme": v.scheme,
            "scheduler_policy": v.policy,
            "metrics": json_safe(outcome.summary()),
            "ratios_to_reference": json_safe(ratios[v.name]),
            "output_throughput_per_repeat": json_safe(throughputs),
            "background_share_per_repeat": [r.get(BACKGROUND_SHARE) for r in outcome.repeats],
            "timings": json_safe(outcome.timings()),
            "unstable_counters": outcome.unstable_counters(result.offline_arrivals),
        }
        if outcome.paired:  # the baseline's code, run beside this one (bm.compare.paired)
            variants[v.name]["paired_baseline_per_repeat"] = [
                json_safe({k: r.get(k) for k in (*TIMING_METRICS, BACKGROUND_SHARE) if k in r})
                for r in outcome.paired
            ]
    return {
        "bm_version": bm.__version__,
        "model": result.model_name,
        "dataset": result.workload,
        "repeat": result.repeat,
        "interrupted": result.interrupted,
        "timed_out": result.timed_out,
        "elapsed_s": result.elapsed_s,
        "identity": result.identity,
        "reference": result.reference,
        "offline_arrivals": result.offline_arrivals,
        "config": result.config.to_dict(),
        "runtime": result.runtime,
        "variants": variants,
        "assertions": [a.to_dict() for a in result.assertions],
        "baseline": None
        if result.baseline_path is None
        else {
            "path": result.baseline_path,
            "tolerance": result.tolerance,
            "noise_factor": result.noise_factor,
            "timings_from": result.timings_from,
            "command": result.baseline_command,
            "pairing_error": result.pairing_error,
            "regressions": [r.to_dict() for r in result.regressions],
            "timing_checks": [c.to_dict() for c in result.timing_checks],
        },
    }
