"""The compare table and compare.md: full variant names at 80 columns, and the simulator's cost."""

from __future__ import annotations

import io

from rich.console import Console

from bm.cli.compare import compare_tables
from bm.compare.render import compare_markdown
from bm.compare.runner import TABLE_COLUMNS, CompareResult, VariantOutcome
from bm.compare.variants import Variant
from bm.config import config_from_dict

NAMES = (
    "inflight_fused:guaranteed_no_evict",
    "inflight_fused:max_utilization",
    "v1:guaranteed_no_evict",
    "v1:max_utilization",
)


def saved_result(*, cost: bool) -> CompareResult:
    """Four scheme:policy variants with plausible figures, built without running a model."""
    outcomes = []
    for i, name in enumerate(NAMES):
        metrics: dict[str, float | int | None] = {key: 1234.5 + i for key, _ in TABLE_COLUMNS}
        metrics.update(
            num_iterations=380_559 + i, total_computed_tokens=12_345_678, mean_kv_cache_utilization=0.5
        )
        if cost:
            metrics.update(cost_usd=0.0123 + i, cost_per_million_output_tokens=0.714)
        scheme, policy = name.split(":")
        outcomes.append(VariantOutcome(Variant(name, "bm", scheme, policy), repeats=[metrics]))
    return CompareResult(
        outcomes, NAMES[0], True, config_from_dict({}), "tiny", {"kind": "synthetic", "num_requests": 4}, 1
    )


def render(result: CompareResult, width: int) -> str:
    console = Console(width=width, file=io.StringIO(), record=True)
    for table in compare_tables(result, width):
        console.print(table)
    return console.export_text()


def test_table_at_80_columns_shows_every_variant_name_and_figure_in_full():
    text = render(saved_result(cost=True), 80)
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 80
    for name in NAMES:
        assert name in text
    assert "380,559" in text and "12,345,678" in text


def test_a_wide_terminal_gets_one_table():
    assert len(compare_tables(saved_result(cost=False), 400)) == 1
    assert len(compare_tables(saved_result(cost=False), 80)) > 1


def test_simulated_cost_is_a_column_of_the_table_and_of_compare_md():
    text = render(saved_result(cost=True), 200)
    assert "cost $" in text and "$ per M out tok" in text and "0.714" in text and "1.01" in text
    markdown = compare_markdown(saved_result(cost=True))
    assert "| cost $ | $ per M out tok |" in markdown and "| 0.714 |" in markdown


def test_runs_without_a_cost_have_no_cost_columns():
    assert "cost" not in render(saved_result(cost=False), 200)
    assert "cost" not in compare_markdown(saved_result(cost=False))
