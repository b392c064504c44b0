"""Plots are valid PNGs with the right content, including for degenerate runs (no stats, all failed)."""

from __future__ import annotations

import matplotlib.image as mpimg
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest

from bm.report.plots import (
    MAX_BARS,
    PLOT_FILES,
    VariantData,
    binned,
    build_figures,
    read_variant_dir,
    write_plots,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _variant(name: str, n: int, iterations: int) -> VariantData:
    requests = pd.DataFrame(
        {
            "ttft_ms": [10.0 * (i + 1) for i in range(n)],
            "tpot_ms": [2.0 + i for i in range(n)],
            "e2el_ms": [50.0 + 7 * i for i in range(n)],
        }
    )
    stats = pd.DataFrame(
        {
            "Iteration Counter": range(1, iterations + 1),
            "Total Context Tokens": [32 if i < 3 else 0 for i in range(iterations)],
            "Total Generation Tokens": [0 if i < 1 else 4 for i in range(iterations)],
            "Generation Requests": [0 if i < 1 else 4 for i in range(iterations)],
            "Empty Generation Slots": [0] * iterations,
            "Used KV cache blocks": [min(i, 10) for i in range(iterations)],
            "Max KV cache blocks": [16] * iterations,
            "Paused Requests": [1 if i == 5 else 0 for i in range(iterations)],
            "Elapsed Time (s)": [0.01 * i for i in range(iterations)],
        }
    )
    return VariantData(name, requests, stats, [100.0, 110.0, 95.0])


def assert_valid_png(path) -> None:
    assert path.read_bytes()[:8] == PNG_MAGIC
    image = mpimg.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert image.std() > 0  # something was drawn, not a blank canvas


def test_every_plot_is_written_as_a_valid_png(tmp_path):
    paths = write_plots([_variant("v1", 8, 20), _variant("inflight_fused", 8, 12)], tmp_path)
    assert [p.name for p in paths] == list(PLOT_FILES)
    for path in paths:
        assert_valid_png(path)


def test_plots_survive_a_variant_with_no_stats_and_no_successful_requests(tmp_path):
    empty = VariantData("hf-cb", pd.DataFrame(), pd.DataFrame(), [])
    paths = write_plots([empty, _variant("v1", 3, 4)], tmp_path)
    for path in paths:
        assert_valid_png(path)


def test_variant_data_reads_back_what_bench_writes(tmp_path):
    v = _variant("v1", 4, 6)
    v.requests.to_json(tmp_path / "requests.jsonl", orient="records", lines=True)
    v.stats.to_json(tmp_path / "stats.jsonl", orient="records", lines=True)
    back = read_variant_dir("v1", tmp_path, [1.0])
    assert list(back.requests["ttft_ms"]) == list(v.requests["ttft_ms"])
    assert list(back.stats["Used KV cache blocks"]) == list(v.stats["Used KV cache blocks"])


def test_the_plots_of_the_plotted_fields_alone_are_the_plots_of_the_whole_files(tmp_path):
    """A long run's files are read for the fields the plots draw only (the whole Azure trace's took
    4.2 GB read whole): every PNG must come out byte for byte the same, so no drawn field is left out."""
    drawn = {}
    for plotted in (False, True):
        directory = tmp_path / f"plotted-{plotted}"
        directory.mkdir()
        v = _variant("v1", 6, 40)
        v.requests["itl_ms"] = [[1.5, 2.5]] * 6  # fields no plot reads, as bench writes them
        v.requests["error"] = None
        v.stats["Empty Generation Slots"] = [i % 3 for i in range(40)]
        v.stats["Timestamp"] = "01-01-2025 00:00:00"
        v.requests.to_json(directory / "requests.jsonl", orient="records", lines=True)
        v.stats.drop(columns=["Generation Requests"]).to_json(
            directory / "stats.jsonl", orient="records", lines=True
        )
        back = read_variant_dir("v1", directory, [1.0], plotted=plotted)
        assert plotted == ("itl_ms" not in back.requests) and "Generation Requests" not in back.stats
        drawn[plotted] = [p.read_bytes() for p in write_plots([back], directory / "plots")]
    assert drawn[True] == drawn[False]


def _spiky(name: str, iterations: int, *, paused: bool) -> VariantData:
    """Context spikes of 1,000 tokens every 50 iterations beside 4 generation tokens each, TTFTs within
    half a millisecond of 167 ms (where matplotlib would label ticks +1.671e2)."""
    requests = pd.DataFrame(
        {"ttft_ms": [167.1 + 0.0001 * i for i in range(8)], "tpot_ms": [2.0] * 8, "e2el_ms": [300.0] * 8}
    )
    stats = pd.DataFrame(
        {
            "Iteration Counter": range(1, iterations + 1),
            "Total Context Tokens": [1000 if i % 50 == 0 else 0 for i in range(iterations)],
            "Total Generation Tokens": [4] * iterations,
            "Used KV cache blocks": [8] * iterations,
            "Max KV cache blocks": [16] * iterations,
            "Paused Requests": [1 if paused and i % 7 == 0 else 0 for i in range(iterations)],
            "Elapsed Time (s)": [0.01 * i for i in range(iterations)],
        }
    )
    return VariantData(name, requests, stats, [100.0])


def _figures(*variants: VariantData) -> dict:
    figures = build_figures(list(variants))
    for fig in figures.values():
        fig.canvas.draw()  # tick labels, offsets and legend positions are settled when drawn
    return figures


def test_tick_labels_are_plain_numbers_without_an_offset():
    figures = _figures(_spiky("inflight_fused:guaranteed_no_evict", 600, paused=True))
    for name, fig in figures.items():
        for ax in fig.axes:
            for axis in (ax.xaxis, ax.yaxis):
                assert axis.get_offset_text().get_text() == "", (name, axis.get_offset_text().get_text())
    plt.close("all")


def test_paused_requests_axis_starts_at_zero_and_says_when_nothing_paused():
    figures = _figures(_spiky("v1", 100, paused=False), _spiky("inflight", 100, paused=False))
    (ax,) = figures["paused_requests.png"].axes
    assert ax.get_ylim()[0] == 0
    assert any(t.get_text() == "no request was paused" for t in ax.texts)
    (ax,) = _figures(_spiky("v1", 100, paused=True))["paused_requests.png"].axes
    assert ax.get_ylim()[0] == 0 and ax.get_ylim()[1] >= 15
    plt.close("all")


def test_legends_sit_below_the_axes_never_over_a_curve():
    long_names = [_spiky(f"inflight_fused:policy_{i}", 200, paused=True) for i in range(4)]
    for name, fig in _figures(*long_names).items():
        renderer = fig.canvas.get_renderer()
        for ax in fig.axes:
            assert ax.get_legend() is None, name
            for legend in fig.legends:
                assert not legend.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer)), name
    plt.close("all")


def test_batch_composition_draws_wide_bars_and_generation_on_its_own_scale():
    fig = _figures(_spiky("v1", 600, paused=False))["batch_composition.png"]
    context, generation = fig.axes
    assert 10 <= len(context.patches) <= MAX_BARS
    assert min(p.get_width() for p in context.patches) >= 600 / MAX_BARS
    # 4 generation tokens an iteration fill their panel instead of vanishing beside 1,000-token spikes
    assert max(p.get_height() for p in generation.patches) == pytest.approx(4)
    assert generation.get_ylim() == (0, pytest.approx(4 * 1.05))
    plt.close("all")


def test_binned_means_cover_every_iteration_once():
    starts, means, size = binned(np.arange(10.0), max_bars=4)
    assert size == 3 and list(starts) == [0, 3, 6, 9]
    assert list(means) == [1.0, 4.0, 7.0, 9.0]
