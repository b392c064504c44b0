"""The engine metrics computed from a real engine run's stats.jsonl, against values worked out by hand.

The metric formulas have their own tests on hand-built frames; those cannot notice a field the engine
spells differently from what the metrics read. Here the engine writes the stats, they go through a
stats.jsonl file and the reader ``bm report`` uses, and every field the metrics read must be there and
add up to what the workload implies.
"""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest

from bm.batch_manager import InferenceRequest
from bm.bench.metrics import STATS_COLUMNS, MissingStatsColumnError, engine_metrics
from bm.report.data import read_variant_dir
from tests.conftest import make_config
from tests.engine_wait import generate_or_fail

# Prompts of 6, 10 and 3 tokens asking for 4, 2 and 5 new tokens (no end token: exactly that many).
PROMPTS = (6, 10, 3)
OUTPUTS = (4, 2, 5)
# Fields bm/report/plots.py draws when present: a misspelling there would silently drop a curve.
PLOT_FIELDS = ("Iteration Counter", "Elapsed Time (s)", "Total Context Tokens", "Total Generation Tokens")


def run_to_stats_file(tiny_model, tmp_path, engine: dict, kv_cache: dict, prompts=PROMPTS, outputs=OUTPUTS):
    """Run the workload, write its stats as stats.jsonl, read it back as bm report does."""
    lines: list[str] = []
    requests = [
        InferenceRequest.from_values(i, [5 + i] * p, m)
        for i, (p, m) in enumerate(zip(prompts, outputs, strict=True))
    ]
    results = generate_or_fail(
        requests, make_config(engine=engine, kv_cache=kv_cache), model=tiny_model, return_stats=lines.append
    )
    with (tmp_path / "stats.jsonl").open("w", encoding="utf-8") as f:
        for line in lines:
            f.write(json.dumps(json.loads(line)) + "\n")
    stats = read_variant_dir("run", tmp_path, []).stats
    records = pd.DataFrame({"num_pauses": [results[i].num_pauses for i in range(len(prompts))]})
    assert [len(results[i].output_ids) for i in range(len(prompts))] == list(outputs)
    return stats, records


def test_a_real_run_has_every_field_the_metrics_and_plots_read(tiny_model, tmp_path):
    stats, _ = run_to_stats_file(
        tiny_model, tmp_path, {"batching_scheme": "inflight_fused"}, {"tokens_per_block": 4}
    )
    missing = [c for c in (*STATS_COLUMNS, *PLOT_FIELDS) if c not in stats.columns]
    assert missing == [], f"bm's stats do not have {missing}; they have {list(stats.columns)}"


def test_inflight_run_metrics_match_the_workload(tiny_model, tmp_path):
    # Blocks of 4 in a 16-block cache. Iteration 1 computes the three contexts (19 tokens) and gives each
    # its first token; every later iteration one generation token per unfinished request: 3, 2, 2, 1
    # (the 2-token request ends after iteration 2, the 4-token one after 4, the 5-token one after 5).
    stats, records = run_to_stats_file(
        tiny_model, tmp_path, {"batching_scheme": "inflight_fused"}, {"tokens_per_block": 4, "max_tokens": 64}
    )
    m = engine_metrics(stats, records)
    assert m["num_iterations"] == 5
    assert m["mean_requests_per_iteration"] == pytest.approx((3 + 3 + 2 + 2 + 1) / 5)
    assert m["mean_tokens_per_iteration"] == pytest.approx((19 + 3 + 2 + 2 + 1) / 5)
    assert m["total_computed_tokens"] == 27  # nothing padded, no empty slots
    assert m["mean_computed_tokens_per_iteration"] == pytest.approx(27 / 5)
    assert m["total_padded_context_tokens"] == 0 and m["total_empty_generation_slots"] == 0
    # Tokens in the cache after each iteration's allocation, per request (6+4, 10+2, 3+5 at most):
    #   it1: 6, 10, 3 -> 2 + 3 + 1 blocks; it2: 7, 11, 4 -> 2 + 3 + 1; it3: 8, -, 5 -> 2 + 2;
    #   it4: 9, -, 6 -> 3 + 2; it5: -, -, 7 -> 2.   Used / 16 blocks: 6, 6, 4, 5, 2.
    assert m["mean_kv_cache_utilization"] == pytest.approx((6 + 6 + 4 + 5 + 2) / 5 / 16)
    assert m["max_kv_cache_utilization"] == pytest.approx(6 / 16)
    assert m["max_paused_per_iteration"] == 0 and m["total_pauses"] == 0
    assert 0 < m["mean_iteration_latency_ms"] <= 1e3 * stats["Elapsed Time (s)"].max()


def test_v1_run_counts_its_padding_and_empty_slots(tiny_model, tmp_path):
    # V1 pads every member to the longest prompt (10) and output (5): 4 + 0 + 7 = 11 pad tokens beside
    # the contexts, and after its last token a member keeps an empty slot each iteration until the
    # batch's 4 generation iterations end: 1 (4 tokens) + 3 (2 tokens) + 0 (5 tokens) = 4.
    stats, records = run_to_stats_file(
        tiny_model, tmp_path, {"batching_scheme": "v1"}, {"tokens_per_block": 4, "max_tokens": 128}
    )
    m = engine_metrics(stats, records)
    assert m["total_padded_context_tokens"] == 11
    assert m["total_empty_generation_slots"] == 4
    assert m["mean_tokens_per_iteration"] == pytest.approx((19 + 3 + 2 + 2 + 1) / m["num_iterations"])
    assert m["total_computed_tokens"] == 19 + 11 + 8 + 4


def test_a_run_with_a_pause_reports_it(tiny_model, tmp_path):
    # Three 4-token prompts, 8 new tokens each, 7 blocks of 4 under MAX_UTILIZATION: the third started
    # is paused once, in one iteration (see test_scheduling_decisions).
    stats, records = run_to_stats_file(
        tiny_model,
        tmp_path,
        {"scheduler_policy": "max_utilization"},
        {"tokens_per_block": 4, "max_tokens": 28},
        prompts=(4, 4, 4),
        outputs=(8, 8, 8),
    )
    m = engine_metrics(stats, records)
    assert m["max_paused_per_iteration"] == 1 and int(stats["Paused Requests"].sum()) == 1
    assert m["num_paused_requests"] == 1 and m["total_pauses"] == 1
    # At the squeeze 0 and 1 grow to 3 blocks each and 2's 2 blocks are freed: 6 of 7 is the peak.
    assert m["max_kv_cache_utilization"] == pytest.approx(6 / 7)


@pytest.fixture(scope="module")
def small_run(tiny_model, tmp_path_factory):
    return run_to_stats_file(
        tiny_model, tmp_path_factory.mktemp("small"), {}, {"tokens_per_block": 4}, prompts=(3,), outputs=(2,)
    )


@pytest.mark.parametrize("column", STATS_COLUMNS)
def test_a_missing_stats_field_fails_loudly_instead_of_counting_as_zero(small_run, column):
    stats, records = small_run
    engine_metrics(stats, records)  # complete: fine
    with pytest.raises(MissingStatsColumnError, match=re.escape(repr(column))):
        engine_metrics(stats.drop(columns=[column]), records)


def test_no_iterations_at_all_gives_zero_totals():
    m = engine_metrics(pd.DataFrame(), pd.DataFrame({"num_pauses": []}))
    assert m["num_iterations"] == 0 and m["total_padded_context_tokens"] == 0
    assert m["mean_tokens_per_iteration"] is None


def test_max_paused_is_the_largest_per_iteration_count_not_the_total():
    row = dict.fromkeys(STATS_COLUMNS, 0) | {"Max KV cache blocks": 10, "Iteration Latency (ms)": 1.0}
    stats = pd.DataFrame([row | {"Paused Requests": n} for n in (1, 2, 0)])
    m = engine_metrics(stats, pd.DataFrame({"num_pauses": [1, 2]}))
    assert m["max_paused_per_iteration"] == 2
