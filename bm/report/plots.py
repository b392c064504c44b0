"""PNG plots of bench and compare runs (matplotlib, headless).

Each plot answers one question a user asks when two batching schemes disagree: how latency is
distributed (CDFs), which variant is fastest (bars with the spread of repeats), what each iteration
actually computed (context vs generation tokens), how full the KV cache ran, and when requests were paused.
Inputs are the files a run writes (requests.jsonl and stats.jsonl per variant), so ``bm report`` can
redraw any saved run.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on CI machines or servers

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from bm.report.data import VariantData, read_variant_dir

__all__ = ["PLOT_FILES", "VariantData", "read_variant_dir", "write_plots"]

PLOT_FILES = (
    "latency_cdf.png",
    "throughput.png",
    "batch_composition.png",
    "kv_utilization.png",
    "paused_requests.png",
)


def write_plots(variants: Sequence[VariantData], out_dir: Path) -> list[Path]:
    """Write every plot into ``out_dir``; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    writers = (
        _latency_cdf,
        _throughput_bars,
        _batch_composition,
        _kv_utilization,
        _paused_requests,
    )
    paths = []
    for name, writer in zip(PLOT_FILES, writers, strict=True):
        path = out_dir / name
        fig = writer(variants)
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths


def _latency_cdf(variants: Sequence[VariantData]) -> plt.Figure:
    metrics = (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("e2el_ms", "E2E latency (ms)"))
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.8))
    for ax, (column, label) in zip(axes, metrics, strict=True):
        drawn = False
        for v in variants:
            if column not in v.requests:
                continue
            values = np.sort(pd.to_numeric(v.requests[column], errors="coerce").dropna().to_numpy())
            if len(values):
                ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=v.name)
                drawn = True
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "no values", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle("Latency CDFs")
    return fig


def _throughput_bars(variants: Sequence[VariantData]) -> plt.Figure:
    fig, ax = plt.subplots(figsize=(max(4, 1.3 * len(variants) + 2), 3.8))
    names = [v.name for v in variants]
    medians = [float(np.median(v.output_throughputs)) if v.output_throughputs else 0.0 for v in variants]
    lows = [m - min(v.output_throughputs, default=m) for m, v in zip(medians, variants, strict=True)]
    highs = [max(v.output_throughputs, default=m) - m for m, v in zip(medians, variants, strict=True)]
    x = np.arange(len(names))
    bars = ax.bar(x, medians, yerr=[lows, highs], capsize=4, color="tab:blue")
    ax.bar_label(bars, fmt="%.0f", fontsize="small")
    ax.set_xticks(x, names, rotation=20, ha="right")
    ax.set_ylabel("output tokens/s (median, range over repeats)")
    ax.set_title("Output throughput")
    ax.grid(axis="y", alpha=0.3)
    return fig


def _per_variant_axes(variants: Sequence[VariantData], title: str) -> tuple[plt.Figure, list[plt.Axes]]:
    n = max(1, len(variants))
    fig, axes = plt.subplots(n, 1, figsize=(8, 2.2 * n + 0.6), sharex=False, squeeze=False)
    fig.suptitle(title)
    return fig, [row[0] for row in axes]


def _with_stats(variants: Sequence[VariantData]) -> list[VariantData]:
    """Variants that report per-iteration stats (the HF baselines do not)."""
    return [v for v in variants if len(v.stats)]


def _batch_composition(variants: Sequence[VariantData]) -> plt.Figure:
    variants = _with_stats(variants) or list(variants[:1])
    fig, axes = _per_variant_axes(variants, "Batch composition per iteration (tokens)")
    for ax, v in zip(axes, variants, strict=False):
        s = v.stats
        if len(s) and "Total Context Tokens" in s:
            it = s["Iteration Counter"] if "Iteration Counter" in s else np.arange(len(s))
            ctx = s["Total Context Tokens"].to_numpy()
            gen_key = "Total Generation Tokens" if "Total Generation Tokens" in s else "Generation Requests"
            gen = s[gen_key].to_numpy() if gen_key in s else np.zeros(len(s))
            ax.stackplot(it, ctx, gen, labels=["context", "generation"], alpha=0.8, step="post")
            if "Empty Generation Slots" in s and s["Empty Generation Slots"].any():
                ax.plot(it, s["Empty Generation Slots"], color="tab:red", lw=0.8, label="empty gen. slots")
            ax.legend(fontsize="x-small", loc="upper right")
        else:
            ax.text(0.5, 0.5, "no per-iteration stats", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(v.name, fontsize="small")
        ax.set_ylabel("tokens")
    axes[-1].set_xlabel("iteration")
    fig.tight_layout()
    return fig


def _kv_utilization(variants: Sequence[VariantData]) -> plt.Figure:
    fig, ax = plt.subplots(figsize=(8, 3.8))
    drawn = False
    for v in variants:
        s = v.stats
        if len(s) and "Used KV cache blocks" in s and "Max KV cache blocks" in s:
            used = s["Used KV cache blocks"] / s["Max KV cache blocks"].where(s["Max KV cache blocks"] > 0)
            it = s["Iteration Counter"] if "Iteration Counter" in s else np.arange(len(s))
            ax.plot(it, used * 100, label=v.name, lw=1)
            drawn = True
    ax.set_xlabel("iteration")
    ax.set_ylabel("KV blocks in use (%)")
    ax.set_ylim(0, 105)
    ax.set_title("KV cache utilization")
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize="small")
    return fig


def _paused_requests(variants: Sequence[VariantData]) -> plt.Figure:
    fig, ax = plt.subplots(figsize=(8, 3.8))
    for v in variants:
        s = v.stats
        if len(s) and "Paused Requests" in s:
            t = s["Elapsed Time (s)"] if "Elapsed Time (s)" in s else np.arange(len(s))
            ax.step(t, s["Paused Requests"].cumsum(), where="post", label=v.name, lw=1)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("pauses so far")
    ax.set_title("Paused requests over time (cumulative)")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    return fig
