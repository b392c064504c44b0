"""Tables never cut a figure: off a terminal they print at their natural width, on a narrow terminal a
cell wraps its characters instead of ending in an ellipsis (``41,048.…`` was what a CI log showed)."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from bm.cli.bench_report import summary_table
from bm.cli.tables import print_table

RESULTS = {
    "model": "smollm2-135m",
    "dataset": {"kind": "azure", "path": "traces/azure_llm_2023_conv_with_a_long_directory_name.csv"},
    "arrivals": {"request_rate": 4.0, "burstiness": 1.0},
    "completed": 19366,
    "failed": 0,
    "duration": 1234.5678,
    "total_input_tokens": 41048123,
    "total_output_tokens": 5123456,
    "request_throughput": 15.687,
    "request_goodput": None,
    "output_throughput": 41048.51,
    "total_token_throughput": 1234567.89,
    "slo_ms": {},
}


def printed(table: Table, *, terminal: bool, width: int = 80) -> str:
    out = io.StringIO()
    print_table(Console(file=out, width=width, force_terminal=terminal, color_system=None), table)
    return out.getvalue()


def test_tables_off_a_terminal_print_every_figure_whole():
    text = printed(summary_table(RESULTS), terminal=False, width=40)
    assert "…" not in text
    for figure in ("41,048.51", "1,234,567.89", "41,048,123", RESULTS["dataset"]["path"]):
        assert figure in text


def test_tables_on_a_narrow_terminal_wrap_a_cell_instead_of_cutting_it():
    table = Table("config", "max_rate", "out tok/s", "p99 TTFT ms", "p99 TPOT ms", "$/M out", "points")
    table.add_row("inflight_fused:bs64:chunk512", "166", "2,348", "399", "23", "0.355", "11")
    table.add_row("inflight_fused:bs16:chunk512", "34.9", "1,350", "367", "10.6", "0.617", "9")
    text = printed(table, terminal=True, width=60)
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 60
    names = "".join(line.split("│")[1].strip() for line in text.splitlines() if line.startswith("│"))
    assert "inflight_fused:bs64:chunk512" in names and "inflight_fused:bs16:chunk512" in names
