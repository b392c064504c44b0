"""PNG plots of bench and compare runs (matplotlib, headless).

Each plot answers one question a user asks when two batching schemes disagree: how latency is
distributed (CDFs), which variant is fastest (bars with the spread of repeats), what each iteration
actually computed (context vs generation tokens), how full the KV cache ran, and when requests were paused.
Inputs are the files a run writes (requests.jsonl and stats.jsonl per variant), so ``bm report`` can
redraw any saved run.

Readable at a glance: a variant has the same colour in every plot; legends sit below the axes, never
over a curve; tick labels are plain numbers (no ``+1.671e2`` offsets); counts start at 0; and per-iteration
token counts are drawn as bars of a few iterations each, context and generation on their own scales, so
neither hairlines nor a context spike can hide the generation tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on CI machines or servers

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.ticker import MaxNLocator, ScalarFormatter

from bm.report.data import VariantData, read_variant_dir

__all__ = ["PLOT_FILES", "VariantData", "build_figures", "read_variant_dir", "write_plots"]

PLOT_FILES = (
    "latency_cdf.png",
    "throughput.png",
    "batch_composition.png",
    "kv_utilization.png",
    "paused_requests.png",
)
MAX_BARS = 60  # bars per batch-composition panel: each wide enough to see
LOG_SPREAD = 100  # a latency axis whose values span more than this factor is drawn on a log scale


def write_plots(variants: Sequence[VariantData], out_dir: Path) -> list[Path]:
    """Write every plot into ``out_dir``; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, fig in build_figures(variants).items():
        path = out_dir / name
        fig.savefig(path, dpi=100, bbox_inches="tight")  # "tight" keeps the legends below the axes
        plt.close(fig)
        paths.append(path)
    return paths


def build_figures(variants: Sequence[VariantData]) -> dict[str, plt.Figure]:
    """Every plot as an open figure, by file name (what tests inspect; the caller closes them)."""
    colours = {v.name: f"C{i % 10}" for i, v in enumerate(variants)}
    writers = (_latency_cdf, _throughput_bars, _batch_composition, _kv_utilization, _paused_requests)
    figures = {}
    for name, writer in zip(PLOT_FILES, writers, strict=True):
        fig = writer(variants, colours)
        for ax in fig.axes:
            _plain_numbers(ax)
        figures[name] = fig
    return figures


def _plain_numbers(ax: plt.Axes) -> None:
    """Tick labels as the numbers themselves: no offset (``+1.671e2``) and no scientific notation."""
    for axis in (ax.xaxis, ax.yaxis):
        formatter = axis.get_major_formatter()
        if isinstance(formatter, ScalarFormatter):
            formatter.set_useOffset(False)
            formatter.set_scientific(False)


def _legend_below(fig: plt.Figure, ax: plt.Axes | None = None) -> None:
    """One legend for the figure, under its axes, so it never covers a curve."""
    handles, labels = [], []
    for axes in [ax] if ax is not None else fig.axes:
        for handle, label in zip(*axes.get_legend_handles_labels(), strict=True):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    if handles:
        fig.tight_layout()
        ncol = min(len(labels), 3)
        fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=ncol, frameon=False)


def _latency_cdf(variants: Sequence[VariantData], colours: dict[str, str]) -> plt.Figure:
    metrics = (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("e2el_ms", "E2E latency (ms)"))
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.8))
    for ax, (column, label) in zip(axes, metrics, strict=True):
        drawn = []
        for v in variants:
            if column not in v.requests:
                continue
            values = np.sort(pd.to_numeric(v.requests[column], errors="coerce").dropna().to_numpy())
            if len(values):
                steps = np.arange(1, len(values) + 1) / len(values)
                ax.step(values, steps, where="post", label=v.name, color=colours[v.name])
                drawn.append(values)
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if drawn:
            _latency_axis(ax, np.concatenate(drawn), label)
        if not drawn:
            ax.text(0.5, 0.5, "no values", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle("Latency CDFs")
    _legend_below(fig)
    return fig


def _latency_axis(ax: plt.Axes, values: np.ndarray, label: str) -> None:
    """Log scale when the variants' latencies span orders of magnitude (a fast variant's curve would
    otherwise be a vertical line at 0); a span of at least 2% of the value when they are all alike, so
    plain tick labels stay few and short (167.1 ms, not 167.1000, 167.1001, ... overprinted)."""
    low, high = float(values.min()), float(values.max())
    if low > 0 and high / low > LOG_SPREAD:
        ax.set_xscale("log")
        ax.set_xlabel(f"{label}, log scale")
        return
    least = max(abs(high) * 0.02, 0.01)
    if high - low < least:
        middle = (high + low) / 2
        ax.set_xlim(max(0.0, middle - least), middle + least)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=6, steps=[1, 2, 5, 10]))


def _throughput_bars(variants: Sequence[VariantData], colours: dict[str, str]) -> plt.Figure:
    fig, ax = plt.subplots(figsize=(max(4, 1.3 * len(variants) + 2), 3.8))
    names = [v.name for v in variants]
    medians = [float(np.median(v.output_throughputs)) if v.output_throughputs else 0.0 for v in variants]
    lows = [m - min(v.output_throughputs, default=m) for m, v in zip(medians, variants, strict=True)]
    highs = [max(v.output_throughputs, default=m) - m for m, v in zip(medians, variants, strict=True)]
    x = np.arange(len(names))
    bars = ax.bar(x, medians, yerr=[lows, highs], capsize=4, color=[colours[n] for n in names])
    ax.bar_label(bars, fmt="%.0f", fontsize="small")
    ax.set_xticks(x, names, rotation=20, ha="right")
    ax.set_ylabel("output tokens/s (median, range over repeats)")
    ax.set_title("Output throughput")
    ax.grid(axis="y", alpha=0.3)
    return fig


def _with_stats(variants: Sequence[VariantData]) -> list[VariantData]:
    """Variants that report per-iteration stats (the HF baselines do not)."""
    return [v for v in variants if len(v.stats)]


def binned(values: np.ndarray, max_bars: int = MAX_BARS) -> tuple[np.ndarray, np.ndarray, int]:
    """Mean of ``values`` over runs of ``size`` consecutive iterations, at most ``max_bars`` runs:
    (first index of each run, its mean, size). A bar per iteration is a hairline at a few hundred."""
    n = len(values)
    size = max(1, -(-n // max_bars))
    starts = np.arange(0, n, size)
    counts = np.diff(np.append(starts, n))
    return starts, np.add.reduceat(np.asarray(values, dtype=float), starts) / counts, size


def _batch_composition(variants: Sequence[VariantData], colours: dict[str, str]) -> plt.Figure:
    variants = _with_stats(variants) or list(variants[:1])
    rows = max(1, len(variants))
    fig, axes = plt.subplots(rows, 2, figsize=(11, 2.3 * rows + 0.8), squeeze=False)
    fig.suptitle("Batch composition: tokens per iteration (each bar the mean over a few iterations)")
    for (ax_ctx, ax_gen), v in zip(axes, variants, strict=False):
        s = v.stats
        if not (len(s) and "Total Context Tokens" in s):
            for ax in (ax_ctx, ax_gen):
                ax.text(0.5, 0.5, "no per-iteration stats", ha="center", va="center", transform=ax.transAxes)
            ax_ctx.set_title(v.name, loc="left", fontsize="small")
            continue
        first = int(s["Iteration Counter"].iloc[0]) if "Iteration Counter" in s else 0
        gen_key = "Total Generation Tokens" if "Total Generation Tokens" in s else "Generation Requests"
        gen = s[gen_key].to_numpy() if gen_key in s else np.zeros(len(s))
        starts, ctx, size = binned(s["Total Context Tokens"].to_numpy())
        x = starts + first
        ax_ctx.bar(x, ctx, width=size, align="edge", color="tab:blue", label="context tokens")
        ax_gen.bar(x, binned(gen)[1], width=size, align="edge", color="tab:orange", label="generation tokens")
        if "Empty Generation Slots" in s and s["Empty Generation Slots"].any():
            empty = binned(s["Empty Generation Slots"].to_numpy())[1]
            ax_gen.bar(x, empty, bottom=binned(gen)[1], width=size, align="edge", color="tab:red", alpha=0.45,
                       hatch="//", label="empty generation slots (computed, no token)")  # fmt: skip
        per = f"bars of {size} iterations" if size > 1 else "one bar per iteration"
        ax_ctx.set_title(f"{v.name}: context ({per})", loc="left", fontsize="small")
        ax_gen.set_title(f"{v.name}: generation", loc="left", fontsize="small")
        for ax in (ax_ctx, ax_gen):
            ax.set_ylabel("tokens / iteration")
            ax.grid(axis="y", alpha=0.3)
    for column in axes.T:  # one scale per column, so variants compare bar for bar; counts from 0
        top = max(max(ax.dataLim.y1, 0.0) for ax in column)
        for ax in column:
            ax.set_ylim(0, top * 1.05 if top > 0 else 1)
    for ax in axes[-1]:
        ax.set_xlabel("iteration")
    _legend_below(fig)
    return fig


def _kv_utilization(variants: Sequence[VariantData], colours: dict[str, str]) -> plt.Figure:
    fig, ax = plt.subplots(figsize=(8, 3.8))
    for v in variants:
        s = v.stats
        if len(s) and "Used KV cache blocks" in s and "Max KV cache blocks" in s:
            used = s["Used KV cache blocks"] / s["Max KV cache blocks"].where(s["Max KV cache blocks"] > 0)
            it = s["Iteration Counter"] if "Iteration Counter" in s else np.arange(len(s))
            ax.plot(it, used * 100, label=v.name, lw=1, color=colours[v.name])
    ax.set_xlabel("iteration")
    ax.set_ylabel("KV blocks in use (%)")
    ax.set_ylim(0, 105)
    ax.set_title("KV cache utilization")
    ax.grid(alpha=0.3)
    _legend_below(fig, ax)
    return fig


def _paused_requests(variants: Sequence[VariantData], colours: dict[str, str]) -> plt.Figure:
    fig, ax = plt.subplots(figsize=(8, 3.8))
    most = 0
    for v in variants:
        s = v.stats
        if len(s) and "Paused Requests" in s:
            t = s["Elapsed Time (s)"] if "Elapsed Time (s)" in s else np.arange(len(s))
            pauses = s["Paused Requests"].cumsum()
            most = max(most, int(pauses.iloc[-1]))
            ax.step(t, pauses, where="post", label=v.name, lw=1.5, color=colours[v.name])
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("pauses so far")
    ax.set_title("Paused requests over time (cumulative)")
    ax.set_ylim(0, max(1, most) * 1.05)  # a count: never below 0, even when nothing paused
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    if most == 0:
        ax.text(0.5, 0.5, "no request was paused", ha="center", va="center", transform=ax.transAxes)
    ax.grid(alpha=0.3)
    _legend_below(fig, ax)
    return fig
