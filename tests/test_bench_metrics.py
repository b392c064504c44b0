"""Every metric formula against small examples computed by hand."""

from __future__ import annotations

import pandas as pd
import pytest

from bm.bench import engine_metrics, latency_stats, records_frame, request_record, run_metrics
from bm.bench.replayer import Timeline
from bm.workloads import Row


def timeline(send: float, tokens: list[float], **kw) -> Timeline:
    values = {"finish_reason": "length", "taken_s": send, "engine_queue_s": 0.0} | kw
    return Timeline(request_id=0, arrival_s=send, send_s=send, token_s=tokens, done_s=tokens[-1], **values)


def record(index: int, ttft: float, tokens: int, gap: float, input_tokens: int = 10) -> dict:
    """A completed request sent at 0 whose first token came at ``ttft`` s, then one per ``gap`` s."""
    times = [ttft + i * gap for i in range(tokens)]
    req = Row(f"line {index}", user_id=index, input_len=input_tokens)
    return request_record(index, req, timeline(0.0, times))


def test_request_record_ttft_tpot_itl_e2el_and_queue_time():
    req = Row("line 1", user_id="a", input_ids=[1, 2, 3, 4])
    tl = timeline(1.0, [1.5, 1.7, 2.0], taken_s=1.1, engine_queue_s=0.05, num_pauses=2)
    r = request_record(0, req, tl)
    assert r["ok"] and r["input_tokens"] == 4 and r["output_tokens"] == 3
    assert r["ttft_ms"] == pytest.approx(500.0)
    assert r["e2el_ms"] == pytest.approx(1000.0)
    assert r["tpot_ms"] == pytest.approx(250.0)  # (1000 - 500) / (3 - 1)
    assert r["itl_ms"] == pytest.approx([200.0, 300.0])
    assert r["queue_time_ms"] == pytest.approx(150.0)  # 100 ms to be taken + 50 ms in the engine queue
    assert r["paused"] and r["num_pauses"] == 2


def test_one_token_output_has_no_tpot_and_no_gaps():
    r = record(0, ttft=0.2, tokens=1, gap=0.0)
    assert r["ok"] and r["tpot_ms"] is None and r["itl_ms"] == []
    assert r["ttft_ms"] == r["e2el_ms"] == pytest.approx(200.0)


def test_a_row_that_never_ran_and_an_engine_error_are_failed_records():
    refused = request_record(0, Row("line 3", error="line 3: prompt: the prompt is empty"), None)
    assert not refused["ok"] and refused["finish_reason"] == "error" and "line 3" in refused["error"]
    engine_error = request_record(
        1, Row("line 4", input_len=5), timeline(0.0, [0.1], finish_reason="error", error="boom")
    )
    assert not engine_error["ok"] and engine_error["ttft_ms"] is None and engine_error["error"] == "boom"
    cancelled = request_record(2, Row("line 5", input_len=5), timeline(0.0, [0.1], finish_reason="cancelled"))
    assert not cancelled["ok"]


def test_latency_stats_mean_median_population_std_and_linear_percentiles():
    stats = latency_stats(pd.Series([100.0, 300.0]), "ttft")
    assert stats["mean_ttft_ms"] == pytest.approx(200.0)
    assert stats["median_ttft_ms"] == pytest.approx(200.0)
    assert stats["std_ttft_ms"] == pytest.approx(100.0)  # ddof=0, as numpy.std
    assert stats["p50_ttft_ms"] == pytest.approx(200.0)
    assert stats["p90_ttft_ms"] == pytest.approx(280.0)
    assert stats["p95_ttft_ms"] == pytest.approx(290.0)
    assert stats["p99_ttft_ms"] == pytest.approx(298.0)
    empty = latency_stats(pd.Series([], dtype=float), "tpot")
    assert set(empty.values()) == {None}


def test_run_metrics_counts_throughputs_goodput_and_pooled_itl():
    records = records_frame(
        [
            record(0, ttft=0.1, tokens=3, gap=0.2, input_tokens=10),  # tpot 200, itl 200, 200
            record(1, ttft=0.3, tokens=2, gap=0.1, input_tokens=20),  # tpot 100, itl 100
            request_record(2, Row("line 3", error="bad"), None),
            record(3, ttft=0.2, tokens=1, gap=0.0, input_tokens=30),  # no tpot
        ]
    )
    m = run_metrics(records, duration_s=4.0, slo_ms={"ttft": 250.0, "tpot": 150.0, "e2el": None})
    assert (m["num_requests"], m["completed"], m["failed"]) == (4, 3, 1)
    assert m["duration"] == 4.0
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (60, 6)
    assert m["request_throughput"] == pytest.approx(3 / 4)
    assert m["output_throughput"] == pytest.approx(6 / 4)
    assert m["total_token_throughput"] == pytest.approx(66 / 4)
    # goodput: request 0 misses TPOT (200 > 150), request 1 misses TTFT (300 > 250), request 3 meets
    # both (a one-token output has no TPOT and meets any TPOT SLO, as in vLLM)
    assert m["request_goodput"] == pytest.approx(1 / 4)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["mean_tpot_ms"] == pytest.approx(150.0)  # over the two requests that have one
    assert m["mean_itl_ms"] == pytest.approx(500.0 / 3)  # pooled gaps 200, 200, 100
    assert m["median_itl_ms"] == pytest.approx(200.0)
    assert m["mean_e2el_ms"] == pytest.approx((500 + 400 + 200) / 3)


def test_goodput_is_null_without_slos_and_a_run_with_nothing_done_is_all_zero():
    records = records_frame([request_record(0, Row("line 1", error="bad"), None)])
    m = run_metrics(records, duration_s=0.0)
    assert m["request_goodput"] is None and m["completed"] == 0 and m["failed"] == 1
    assert m["request_throughput"] == 0.0 and m["mean_ttft_ms"] is None


def stats_row(used: int, ctx: int, gen: int, computed: int, paused: int = 0, empty: int = 0) -> dict:
    return {
        "Max KV cache blocks": 10,
        "Used KV cache blocks": used,
        "Scheduled Requests": (1 if ctx else 0) + gen,
        "Total Context Tokens": ctx,
        "Total Generation Tokens": gen,
        "Computed Tokens": computed,
        "Padded Context Tokens": computed - ctx - gen - empty,
        "Empty Generation Slots": empty,
        "Paused Requests": paused,
        "Iteration Latency (ms)": 10.0 if ctx else 2.0,
        "Draft Steps": 0,
        "Draft Tokens": 0,
        "Accepted Draft Tokens": 0,
    }


def test_engine_metrics_from_iteration_stats():
    stats = pd.DataFrame(
        [stats_row(2, ctx=8, gen=0, computed=8), stats_row(6, ctx=0, gen=3, computed=4, empty=1, paused=1)]
    )
    records = records_frame([record(0, 0.1, 2, 0.1) | {"num_pauses": 2}, record(1, 0.1, 2, 0.1)])
    m = engine_metrics(stats, records)
    assert m["num_iterations"] == 2
    assert m["mean_kv_cache_utilization"] == pytest.approx(0.4)
    assert m["max_kv_cache_utilization"] == pytest.approx(0.6)
    assert m["mean_requests_per_iteration"] == pytest.approx(2.0)
    assert m["mean_tokens_per_iteration"] == pytest.approx(5.5)  # (8 + 3) / 2
    assert m["mean_computed_tokens_per_iteration"] == pytest.approx(6.0)
    assert m["total_computed_tokens"] == 12 and m["total_empty_generation_slots"] == 1
    assert m["mean_iteration_latency_ms"] == pytest.approx(6.0)
    assert m["num_paused_requests"] == 1 and m["total_pauses"] == 2 and m["max_paused_per_iteration"] == 1


@pytest.mark.parametrize(("slo", "good"), [(250.0, 1), (249.0, 0), (251.0, 1)])
def test_a_request_exactly_at_its_slo_counts_as_good(slo, good):
    # TTFT 0.25 s is exactly 250 ms; vLLM counts a request as good when its latency is <= the SLO.
    records = records_frame([record(0, ttft=0.25, tokens=1, gap=0.0)])
    m = run_metrics(records, duration_s=1.0, slo_ms={"ttft": slo})
    assert m["request_goodput"] == good
