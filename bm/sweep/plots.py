"""A sweep's PNGs (matplotlib, headless), drawn from the points it saved.

- ``slo_<metric>.png``: the SLO metric against load for each configuration, one panel per value of the
  first axis, with the SLO line; the highest feasible load of each line is marked.
- ``pareto.png``: tokens/s per user (1000 / mean TPOT) against output tokens/s per device, every point;
  feasible points filled, the front over feasible points drawn (``vllm bench sweep plot_pareto``'s axes).
- ``cost.png`` (simulator): cost per million output tokens at each configuration's highest feasible load.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt

from bm.sweep.runner import ConfigOutcome, Point, SweepPlan

_UNITS = {"rate": "request rate (req/s)", "concurrency": "concurrency", "trace": "trace speed-up (x)"}


def write_plots(out_dir: Path, plan: SweepPlan, outcomes: list[ConfigOutcome]) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = {f"slo_{name}.png": _slo_plot(plan, outcomes, name) for name in plan.slo.limits}
    figures["pareto.png"] = _pareto(outcomes, plan.load)
    if any(_cost(o) is not None for o in outcomes):
        figures["cost.png"] = _cost_bars(outcomes)
    paths = []
    for file, fig in figures.items():
        path = out_dir / file
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths


def _groups(outcomes: list[ConfigOutcome]) -> dict[str, list[ConfigOutcome]]:
    """Panels by the first varying setting's value (one panel when nothing varies)."""
    keys = [
        k
        for k in (outcomes[0].settings if outcomes else {})
        if len({str(o.settings[k]) for o in outcomes}) > 1
    ]
    if not keys:
        return {"": outcomes}
    panels: dict[str, list[ConfigOutcome]] = {}
    for o in outcomes:
        panels.setdefault(str(o.settings[keys[0]]), []).append(o)
    return panels


def _slo_plot(plan: SweepPlan, outcomes: list[ConfigOutcome], metric: str) -> plt.Figure:
    panels = _groups(outcomes)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 5.5), squeeze=False, sharey=True)
    limit = plan.slo.limits[metric]
    colors = plt.get_cmap("tab20").colors
    for ax, (title, group) in zip(axes[0], panels.items(), strict=True):
        for i, o in enumerate(group):
            color = colors[i % len(colors)]
            label = o.name.removeprefix(f"{title}:") if title else o.name
            points = [p for p in o.points if p.slo_values.get(metric) is not None]
            full = [p for p in points if not p.metrics.get("stopped_early")]
            early = [p for p in points if p.metrics.get("stopped_early")]
            ax.plot(
                [p.load for p in full],
                [p.slo_values[metric] for p in full],
                "o-",
                ms=3,
                color=color,
                label=label,
            )
            ax.plot([p.load for p in early], [p.slo_values[metric] for p in early], "x", ms=6, color=color)
            best = o.best()
            if best is not None and best.slo_values.get(metric) is not None:
                ax.plot([best.load], [best.slo_values[metric]], "*", ms=12, color=color, mec="black", mew=0.5)
        ax.axhline(limit, color="red", ls="--", lw=1.2, label=f"SLO {limit:g} ms")
        ax.set_yscale("log")
        ax.set_xlabel(_UNITS[plan.load])
        ax.set_title(title or "all configurations")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    axes[0][0].set_ylabel(f"p{plan.slo.percentile:g} {metric.upper()} (ms, log)")
    fig.suptitle(
        f"p{plan.slo.percentile:g} {metric.upper()} against load. Star: highest feasible load; "
        "x: point stopped early once the SLO was certainly missed (value over the requests done by then)"
    )
    return fig


def _per_user(p: Point) -> float | None:
    tpot = p.metrics.get("mean_tpot_ms")
    return 1000.0 / tpot if tpot else None


def _per_device(p: Point) -> float | None:
    out = p.metrics.get("output_throughput")
    devices = p.metrics.get("num_devices") or 1
    return out / devices if out is not None else None


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def _pareto(outcomes: list[ConfigOutcome], load: str = "rate") -> plt.Figure:
    """Every fully run point, one colour and marker per configuration (filled: feasible, hollow: not),
    and the Pareto front of the feasible ones with each of its points named ``config @ load``: the plot
    answers "which configuration gives this trade-off", not only "some configuration does"."""
    fig, ax = plt.subplots(figsize=(9, 6))
    colours = plt.get_cmap("tab10").colors
    front: dict[tuple[float, float], list[str]] = {}  # a position -> every configuration point there
    for i, o in enumerate(outcomes):
        colour, marker = colours[i % len(colours)], MARKERS[(i // len(colours)) % len(MARKERS)]
        shown = [(p, _per_user(p), _per_device(p)) for p in o.points if not p.metrics.get("stopped_early")]
        shown = [(p, x, y) for p, x, y in shown if x is not None and y is not None]
        good = [(x, y) for p, x, y in shown if p.feasible]
        bad = [(x, y) for p, x, y in shown if not p.feasible]
        ax.scatter([x for x, _ in good], [y for _, y in good], s=22, color=colour, marker=marker, label=o.name,
                   alpha=0.8)  # fmt: skip
        ax.scatter([x for x, _ in bad], [y for _, y in bad], s=22, marker=marker, facecolors="none",
                   edgecolors=colour)  # fmt: skip
        for p, x, y in shown:
            if p.feasible:  # configurations that behave alike (bs16 and bs64 at a low rate) share a label
                front.setdefault((x, y), []).append(f"{o.name} @ {load} {p.load:g}")
    pareto = _front([(x, y, "\n".join(names)) for (x, y), names in front.items()])
    if pareto:
        ax.plot([x for x, _, _ in pareto], [y for _, y, _ in pareto], "-", color="grey", lw=1.5, zorder=0,
                label="Pareto front (feasible)")  # fmt: skip
        for x, y, name in pareto:
            ax.annotate(name, (x, y), xytext=(4, 4), textcoords="offset points", fontsize=7)
    ax.set_xlabel("tokens/s per user (1000 / mean TPOT ms)")
    ax.set_ylabel("output tokens/s per device")
    ax.set_title("Throughput per device against speed per user (hollow: misses the SLO)")
    ax.grid(alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=7, title="configuration")
    fig.tight_layout()
    return fig


def _front(points: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """Points no other beats on both axes, by increasing per-user speed."""
    out: list[tuple[float, float, str]] = []
    for x, y, name in sorted(points, key=lambda p: (-p[0], -p[1])):
        if not out or y > out[-1][1]:
            out.append((x, y, name))
    return sorted(out)


def _cost(o: ConfigOutcome) -> float | None:
    best = o.best()
    return best.metrics.get("cost_per_million_output_tokens") if best is not None else None


def _cost_bars(outcomes: list[ConfigOutcome]) -> plt.Figure:
    rows = sorted(((o.name, _cost(o)) for o in outcomes if _cost(o) is not None), key=lambda r: r[1])
    fig, ax = plt.subplots(figsize=(8, 0.28 * len(rows) + 1.5))
    ax.barh([name for name, _ in rows], [cost for _, cost in rows], color="tab:green")
    for i, (_, cost) in enumerate(rows):
        ax.text(cost, i, f" ${cost:.3f}", va="center", fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("$ per million output tokens at the highest feasible load")
    missing = len(outcomes) - len(rows)
    ax.set_title(
        "Cost at the SLO (simulated)"
        + (f"; {missing} configurations with no feasible load left out" if missing else "")
    )
    ax.tick_params(axis="y", labelsize=7)
    ax.grid(axis="x", alpha=0.3)
    return fig
