"""``bm compare``'s results as people read them: the table, compare.md (with the baseline gate's
account of how it judged) and the files of a comparison (compare.json, compare.md, each variant's
results.json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bm.bench import write_results
from bm.compare.expr import AssertionOutcome
from bm.compare.load import BACKGROUND_SHARE, QUIET_SHARE, is_quiet
from bm.compare.regress import TimingCheck, slow_baseline_note
from bm.compare.runner import TABLE_COLUMNS, CompareResult, compare_document
from bm.files import write_whole
from bm.report.data import variant_dir

# The simulator's cost (hourly price x devices x simulated time): shown when any variant has one.
COST_COLUMNS: tuple[tuple[str, str], ...] = (
    ("cost_usd", "cost $"),
    ("cost_per_million_output_tokens", "$ per M out tok"),
)


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
        note = slow_baseline_note(result.timing_checks) if result.timings_from == "saved" else None
        if note:
            lines.append(f"- ⚠️ {note}")
        if result.timing_checks:
            lines += [
                "",
                "| timing | baseline median | this run's median | worse by | bounds (paired) | margin |",
                "|---|---:|---:|---:|---:|---:|",
            ]
            lines += [_check_row(c) for c in result.timing_checks]
    return "\n".join(lines) + "\n"


def gate_rule(result: CompareResult) -> str:
    """One sentence saying how the baseline gate judged this run's timings (paired, saved or simulated),
    with the margins it used."""
    tol, k = result.tolerance or 0.0, result.noise_factor or 0.0
    if result.timings_from == "simulated":
        return (
            "Counters and the simulator's timings must match the baseline's exactly (virtual time: the "
            "same code, config and workload give the same bits every run)."
        )
    if result.timings_from == "paired":
        settled = sum(c.judged for c in result.timing_checks)
        return (
            f"Counters must match exactly; timings were judged on {result.repeat} paired round(s) with the "
            f"baseline's code (--baseline-cmd {result.baseline_command}), alternated in this sitting over "
            f"{result.elapsed_s or 0:.0f} s: a timing regressed when worse than the tolerance {tol:.0%} with "
            f"99.9% confidence, held when within it with 95% (sign test on the pairs' ratios); {settled} of "
            f"{len(result.timing_checks)} timing(s) settled."
        )
    margins = [c.margin for c in result.timing_checks if c.judged]
    span = (
        f"{min(margins):.0%}" if min(margins) == max(margins) else f"{min(margins):.0%}-{max(margins):.0%}"
    ) if margins else "none"  # fmt: skip
    shares = [r.get(BACKGROUND_SHARE) for v in result.variants for r in v.repeats]
    quiet = sum(is_quiet(s) for s in shares)
    why = (
        f"the baseline command failed: {result.pairing_error}"
        if result.pairing_error
        else "no --baseline-cmd"
    )
    return (
        f"Timings were judged against the baseline's saved timings (not paired: {why}). "
        f"Counters must match exactly; each timing's median over {result.repeat} repeat(s) ({quiet} of "
        f"{len(shares)} runs had the machine to themselves, others at most {QUIET_SHARE:.0%} of the CPU; "
        f"only those count) may be worse than the baseline's median by at most max(tolerance {tol:.0%}, "
        f"{k:g} x the larger measured spread): margins used {span}."
    )


def _check_row(c: TimingCheck) -> str:
    """A timing check as a row of compare.md's table."""
    bounds = "–" if c.pairs is None else f"{_pct(c.low)} to {_pct(c.high)}"
    why = "" if c.judged else (" (not judged: too noisy)" if c.unsettled else " (not judged: busy)")
    return (
        f"| `{c.variant}.{c.metric}` | {c.previous:.4g} | {c.current:.4g} | {c.worse_by:+.1%} | {bounds} | "
        f"{c.margin:.1%}{' ❌' if c.regressed else ''}{why} |"
    )


def _pct(x: float | None) -> str:
    return "–" if x is None else (f"{x:+.1%}" if abs(x) != float("inf") else "unbounded")


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
