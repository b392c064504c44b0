"""Plots are valid PNGs with the right content, including for degenerate runs (no stats, all failed)."""

from __future__ import annotations

import matplotlib.image as mpimg
import pandas as pd

from bm.report.plots import PLOT_FILES, VariantData, read_variant_dir, write_plots

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
