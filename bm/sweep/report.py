"""A sweep's outputs: ``sweep.json``, ``sweep.csv`` (one row per configuration and load point, every
``bm bench`` metric and the feasibility flag), ``sweep.md``, and its CI gates.

Gates work as in ``bm compare``: ``--assert`` expressions over each configuration's figures, by name
(``inflight_fused.max_load >= 1.5 * v1.max_load``), and a saved ``sweep.json`` as a baseline: a
configuration's highest feasible load may not fall by more than the tolerance (under the simulator it
is deterministic, so the default tolerance there is 0).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from bm.compare.baseline_file import read_baseline_document
from bm.files import write_whole
from bm.sweep.runner import ConfigOutcome, SweepPlan

# per-configuration figures an --assert may read, beside the metrics at the highest feasible load
SUMMARY_KEYS = ("max_load", "max_rate", "max_concurrency", "max_speedup", "num_points")
_LOAD_NAME = {"rate": "max_rate", "concurrency": "max_concurrency", "trace": "max_speedup"}
_TABLE = (
    ("output_throughput", "out tok/s"),
    ("p99_ttft_ms", "p99 TTFT ms"),
    ("p99_tpot_ms", "p99 TPOT ms"),
    ("cost_per_million_output_tokens", "$/M out"),
)


def summary(plan: SweepPlan, outcome: ConfigOutcome) -> dict[str, Any]:
    """A configuration's figures: its highest feasible load (under the load's own name too) and
    every metric of the point at that load."""
    best = outcome.best()
    figures: dict[str, Any] = dict(best.metrics) if best is not None else {}
    figures |= {"max_load": outcome.max_load, _LOAD_NAME[plan.load]: outcome.max_load}
    figures["num_points"] = len(outcome.points)
    return figures


def sweep_document(plan: SweepPlan, outcomes: list[ConfigOutcome], extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "load": plan.load,
        "slo": {"percentile": plan.slo.percentile, "limits_ms": plan.slo.limits},
        "precision": plan.precision,
        "repeats": plan.repeats,
        **extra,
        "configs": {
            o.name: {
                "settings": o.settings,
                "max_load": o.max_load,
                "summary": summary(plan, o),
                "points": [p.to_json() for p in o.points],
            }
            for o in outcomes
        },
    }


def write_outputs(
    out_dir: Path, plan: SweepPlan, outcomes: list[ConfigOutcome], extra: dict[str, Any]
) -> dict:
    """sweep.json, sweep.csv and sweep.md into ``out_dir``; returns the JSON document."""
    document = sweep_document(plan, outcomes, extra)
    write_whole(out_dir / "sweep.json", json.dumps(document, indent=2) + "\n")
    _write_csv(out_dir / "sweep.csv", plan, outcomes)
    write_whole(out_dir / "sweep.md", markdown(plan, outcomes))
    return document


def _write_csv(path: Path, plan: SweepPlan, outcomes: list[ConfigOutcome]) -> None:
    settings = list(dict.fromkeys(k for o in outcomes for k in o.settings))
    metrics = list(dict.fromkeys(k for o in outcomes for p in o.points for k in p.metrics))
    slo = [f"slo_p{plan.slo.percentile:g}_{name}_ms" for name in plan.slo.limits]
    with path.open("w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["config", *settings, "load_kind", "load", "feasible", *slo, *metrics])
        for o in outcomes:
            for p in o.points:
                row = [o.name, *(o.settings.get(k) for k in settings), plan.load, p.load, p.feasible]
                row += [p.slo_values.get(name) for name in plan.slo.limits]
                row += [p.metrics.get(k) for k in metrics]
                writer.writerow(row)


def table(plan: SweepPlan, outcomes: list[ConfigOutcome]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the results table (highest load first)."""
    header = ["config", _LOAD_NAME[plan.load], *(label for _, label in _TABLE), "points"]
    rows = []
    for o in sorted(outcomes, key=lambda o: -(o.max_load or 0)):
        figures = summary(plan, o)
        cells = [o.name, _fmt(o.max_load)]
        cells += [_fmt(figures.get(key)) for key, _ in _TABLE]
        rows.append([*cells, str(len(o.points))])
    return header, rows


def markdown(plan: SweepPlan, outcomes: list[ConfigOutcome]) -> str:
    header, rows = table(plan, outcomes)
    lines = [
        f"# bm sweep: highest {plan.load} within {plan.slo.describe()}",
        "",
        f"Precision {plan.precision:.0%}; metrics at each configuration's highest feasible load.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


# -- gates -----------------------------------------------------------------------------------------------


def gate_metrics(plan: SweepPlan, outcomes: list[ConfigOutcome]) -> dict[str, dict[str, Any]]:
    return {o.name: summary(plan, o) for o in outcomes}


def read_baseline(path: Path) -> dict[str, Any]:
    return read_baseline_document(path, "sweep", "configs")


def regressions(previous: dict[str, Any], outcomes: list[ConfigOutcome], tolerance: float) -> list[str]:
    """A configuration of the baseline missing now, or whose highest feasible load fell by more than
    ``tolerance`` (relative)."""
    now = {o.name: o.max_load for o in outcomes}
    found = []
    for name, entry in previous["configs"].items():
        before = entry.get("max_load") if isinstance(entry, dict) else None
        if name not in now:
            found.append(f"{name}: in the baseline but not in this sweep")
        elif before is not None and (now[name] is None or now[name] < before * (1 - tolerance)):
            found.append(f"{name}: max_load {_fmt(now[name])} < baseline {_fmt(before)} - {tolerance:.0%}")
    return found
