"""``bm compare``'s library side: variants, interleaved repeats, summaries, ratios and the result files.

Every variant runs in one process on one loaded model, on the identical workload and arrival times.
Repeats are interleaved (v1, inflight, ..., v1, inflight, ...) rather than run back to back, so a slow
stretch of the machine (another job, thermal throttling) spreads over all variants instead of landing on
one. Each figure reported is the median over repeats; the spread of output throughput is kept.

The reference baselines (``hf-generate``, ``hf-cb``) are run on the same model weights and the same
requests. They have no notion of arrival times: they always run offline (everything at t=0), to each
request's full output length, and report throughput only, since neither exposes per-token timing.
"""

from __future__ import annotations

import json
import statistics
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bm
from bm.baselines import run_hf_continuous_batching, run_hf_generate
from bm.bench import BenchResult, run_bench, write_results
from bm.bench.journal import BenchJournal
from bm.bench.results import json_safe
from bm.compare.expr import AssertionOutcome
from bm.compare.load import BACKGROUND_SHARE, QUIET_SHARE, is_quiet
from bm.compare.regress import (
    EXACT_IF_OFFLINE,
    TIMING_METRICS,
    Regression,
    TimingCheck,
    kv_block_counters,
    slow_baseline_note,
    summarize_timing,
)
from bm.compare.variants import Variant, variant_config
from bm.config import BmConfig, ConfigError
from bm.cpu_load import background_share, read_ticks
from bm.files import write_whole
from bm.report.data import variant_dir
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
# The simulator's cost (hourly price x devices x simulated time): shown when any variant has one.
COST_COLUMNS: tuple[tuple[str, str], ...] = (
    ("cost_usd", "cost $"),
    ("cost_per_million_output_tokens", "$ per M out tok"),
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
    runnable = [(r.input_ids, r.output_len) for r in workload.requests if r.ok and r.input_ids is not None]
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
) -> CompareResult:
    """Run ``repeat`` interleaved rounds of every variant and collect their metrics.

    ``stop`` (the command's first signal): the run in progress is cut short, no other starts, and the
    round it was in is dropped, so every variant keeps the same finished rounds (none, when the first
    was cut short); the result says ``interrupted``.

    ``more_rounds``: asked after the rounds run so far, how many more to run (0: done); the baseline gate
    uses it to re-measure before it calls a timing a regression, or when the machine was too noisy to
    judge.

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
        else runtime_info(loaded.device, loaded.dtype),
    )
    rounds = repeat
    while rounds > 0:
        for _ in range(rounds):
            round_index = result.repeat
            for outcome in outcomes:
                if stop is not None and stop.is_set():
                    break
                v = outcome.variant
                if on_start:
                    on_start(v, round_index, {})
                before = read_ticks()
                if v.kind == "bm":
                    with journal(v) if journal is not None else nullcontext() as run_journal:
                        run = run_bench(
                            configs[v.name], loaded, workload, arrivals, journal=run_journal, stop=stop
                        )
                    metrics = dict(run.metrics) | kv_block_counters(run.iterations)
                    outcome.last = run
                else:
                    metrics = _baseline_metrics(v.name, loaded, workload, hf_batch_size, stop)
                metrics[BACKGROUND_SHARE] = background_share(before, read_ticks())
                outcome.repeats.append(metrics)
                if on_done:
                    on_done(v, round_index, metrics)
            if stop is not None and stop.is_set():
                for outcome in outcomes:  # the round cut short: its figures are partial
                    del outcome.repeats[result.repeat :]
                result.interrupted = True
                return result
            result.repeat += 1
        rounds = more_rounds(result) if more_rounds is not None else 0
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
    return {
        "bm_version": bm.__version__,
        "model": result.model_name,
        "dataset": result.workload,
        "repeat": result.repeat,
        "interrupted": result.interrupted,
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
            "regressions": [r.to_dict() for r in result.regressions],
            "timing_checks": [c.to_dict() for c in result.timing_checks],
        },
    }


def format_value(key: str, value: Any) -> str:
    if value is None:
        return "–"
    if key == "mean_kv_cache_utilization":
        return f"{value:.0%}"
    if key.startswith("cost"):
        return f"{value:.3g}"
    if isinstance(value, int):
        return f"{value:,}"
    if key.endswith("_throughput"):
        return f"{value:.1f}" if key == "output_throughput" else f"{value:.2f}"
    return f"{value:.1f}"


def table_rows(result: CompareResult) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the comparison table, shared by the terminal and Markdown renderings."""
    summaries = {outcome.variant.name: outcome.summary() for outcome in result.variants}
    costed = any(s.get(key) is not None for s in summaries.values() for key, _ in COST_COLUMNS)
    columns = TABLE_COLUMNS + (COST_COLUMNS if costed else ())
    header = ["variant", *[h for _, h in columns], f"× {result.reference} (out tok/s)"]
    ratios = result.ratios()
    rows = []
    for name, summary in summaries.items():
        ratio = ratios[name]["output_throughput"]
        cells = [name, *[format_value(k, summary.get(k)) for k, _ in columns]]
        cells.append("–" if ratio is None else f"{ratio:.2f}×")
        rows.append(cells)
    return header, rows


def compare_markdown(result: CompareResult) -> str:
    """A Markdown report fit for a CI job summary or a PR comment."""
    header, rows = table_rows(result)
    info = result.workload
    lines = [
        "## bm compare",
        "",
        f"Model `{result.model_name}`, dataset `{info.get('kind')}` {info.get('path') or ''} "
        f"({info.get('num_requests')} requests), {'offline arrivals' if result.offline_arrivals else 'timed arrivals'}, "
        f"median of {result.repeat} interleaved repeat(s). Latencies in ms.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|",
    ]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    if any(v.variant.kind == "baseline" for v in result.variants):
        lines += [
            "",
            "Baselines run offline, each request to its full output length; they report throughput only.",
        ]
    unstable = {v.variant.name: v.unstable_counters(result.offline_arrivals) for v in result.variants}
    unstable = {k: u for k, u in unstable.items() if u}
    if unstable:
        lines += [
            "",
            "**Warning:** counters differed between repeats: "
            + "; ".join(f"{k}: {', '.join(u)}" for k, u in unstable.items()),
        ]
    if result.assertions:
        lines += ["", "### Assertions", ""]
        for a in result.assertions:
            mark = "✅" if a.passed else "❌"
            lines.append(f"- {mark} `{a.text}` — {_fmt_pair(a)}")
    if result.baseline_path is not None:
        lines += ["", f"### Against baseline `{result.baseline_path}`", "", gate_rule(result), ""]
        if result.regressions:
            lines += [f"- ❌ `{r.variant}.{r.metric}`: {r.detail}" for r in result.regressions]
        else:
            lines.append("- ✅ no regressions")
        note = slow_baseline_note(result.timing_checks)
        if note:
            lines.append(f"- ⚠️ {note}")
        if result.timing_checks:
            lines += [
                "",
                "| timing | baseline median | this run's median | worse by | margin |",
                "|---|---:|---:|---:|---:|",
            ]
            lines += [
                f"| `{c.variant}.{c.metric}` | {c.previous:.4g} | {c.current:.4g} | {c.worse_by:+.1%} | "
                f"{c.margin:.1%}{' ❌' if c.regressed else ''}{'' if c.judged else ' (not judged: busy)'} |"
                for c in result.timing_checks
            ]
    return "\n".join(lines) + "\n"


def gate_rule(result: CompareResult) -> str:
    """One sentence saying how the baseline gate judged this run, with the margins it used."""
    tol, k = result.tolerance or 0.0, result.noise_factor or 0.0
    margins = [c.margin for c in result.timing_checks if c.judged]
    span = (
        f"{min(margins):.0%}" if min(margins) == max(margins) else f"{min(margins):.0%}-{max(margins):.0%}"
    ) if margins else "none"  # fmt: skip
    shares = [r.get(BACKGROUND_SHARE) for v in result.variants for r in v.repeats]
    quiet = sum(is_quiet(s) for s in shares)
    return (
        f"Counters must match exactly; each timing's median over {result.repeat} repeat(s) ({quiet} of "
        f"{len(shares)} runs had the machine to themselves, others at most {QUIET_SHARE:.0%} of the CPU; "
        f"only those count) may be worse than the baseline's median by at most max(tolerance {tol:.0%}, "
        f"{k:g} x the larger measured spread): margins used {span}."
    )


def _fmt_pair(a: AssertionOutcome) -> str:
    text = f"{a.left:.4g} {a.cmp} {a.right:.4g}"
    if not a.passed:
        gap = abs(a.left - a.right)
        text += f", off by {gap:.4g}" + (f" ({gap / abs(a.right):.1%})" if a.right else "")
    return text


def write_compare(out_dir: Path, result: CompareResult) -> dict[str, Any]:
    """compare.json, compare.md, and each bm variant's last-repeat ``results.json`` under
    ``variants/NAME/``, beside the ``requests.jsonl`` and ``stats.jsonl`` its journal wrote there (the
    ``journal`` of :func:`run_compare`: the run keeps no record)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    document = compare_document(result)
    write_whole(out_dir / "compare.json", json.dumps(document, indent=2) + "\n")
    write_whole(out_dir / "compare.md", compare_markdown(result))
    for outcome in result.variants:
        if outcome.last is not None:
            write_results(variant_dir(out_dir, outcome.variant.name), outcome.last)
    return document
