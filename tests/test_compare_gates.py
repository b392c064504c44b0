"""The CI gates of ``bm compare``: the --assert grammar (never eval) and --baseline regression checks."""

from __future__ import annotations

import builtins

import pytest

from bm.compare.expr import (
    AssertionEvalError,
    AssertionSyntaxError,
    check_refs,
    evaluate_assertion,
    parse_assertion,
)
from bm.compare.regress import find_regressions, parse_tolerance

METRICS = {
    "v1": {"output_throughput": 100.0, "p99_ttft_ms": 50.0, "completed": 8, "missing": None},
    "inflight_fused": {"output_throughput": 250.0, "p99_ttft_ms": 20.0, "completed": 8},
    "hf-generate": {"output_throughput": 40.0},
    "inflight_fused:max_utilization": {"output_throughput": 260.0},
}


def check(text: str) -> bool:
    return evaluate_assertion(parse_assertion(text), METRICS).passed


def test_issue_example_assertion_passes_and_its_converse_fails():
    assert check("inflight_fused.output_throughput >= 2 * v1.output_throughput")
    assert not check("inflight_fused.output_throughput >= 3 * v1.output_throughput")


def test_arithmetic_follows_usual_precedence_and_parentheses():
    assert check("v1.output_throughput + 2 * 25 == 150")
    assert check("(v1.output_throughput + 2) * 2 == 204")
    assert check("-v1.output_throughput < 0")
    assert check("v1.output_throughput / 4 == 25")
    assert check("v1.output_throughput-1 == 99")  # metric names hold no '-': this is a subtraction
    assert check("inflight_fused.p99_ttft_ms <= 50% * v1.p99_ttft_ms")
    assert check("1e2 == v1.output_throughput")


def test_variant_names_may_hold_hyphens_colons_and_plus():
    assert check("v1.output_throughput >= 2 * hf-generate.output_throughput")
    assert check("inflight_fused:max_utilization.output_throughput > inflight_fused.output_throughput")


def test_failed_assertion_message_says_which_figure_and_by_how_much():
    outcome = evaluate_assertion(
        parse_assertion("inflight_fused.output_throughput >= 3 * v1.output_throughput"), METRICS
    )
    assert not outcome.passed
    assert outcome.left == 250.0 and outcome.right == 300.0
    assert "FAILED" in outcome.message and "off by 50" in outcome.message and "16.7%" in outcome.message


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os').system('echo pwned')",
        "v1.output_throughput >= 1; import os",
        "v1.__class__.__bases__ >= 1",
        "v1.output_throughput >= open('x')",
        "lambda: 1 >= 0",
        "v1.output_throughput[0] >= 1",
        "v1.output_throughput >= 1 >= 0",
        "v1.output_throughput",
        "v1.output_throughput >=",
        "(v1.output_throughput >= 1",
        "'abc' == 'abc'",
        "",
        "v1.output_throughput >= " + "(" * 40 + "1" + ")" * 40,
        "1 == " + "1+" * 300 + "1",
    ],
)
def test_hostile_or_malformed_assertions_are_rejected_without_executing_anything(text, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("the assertion language must never reach eval/exec/import")

    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    monkeypatch.setattr(builtins, "__import__", forbidden)
    with pytest.raises(AssertionSyntaxError):
        parse_assertion(text)


def test_syntax_error_points_at_the_offending_column():
    with pytest.raises(AssertionSyntaxError, match="column 25") as err:
        parse_assertion("v1.output_throughput >= $5")
    assert "^" in str(err.value)


def test_unknown_variant_or_metric_is_named_with_the_alternatives():
    with pytest.raises(AssertionEvalError, match=r"no variant 'v2'.*variants: .*inflight_fused"):
        check_refs(parse_assertion("v2.output_throughput > 0"), METRICS)
    with pytest.raises(AssertionEvalError, match="did you mean output_throughput"):
        check_refs(parse_assertion("v1.output_throughput_x > 0"), METRICS)


def test_null_metric_and_division_by_zero_are_evaluation_errors():
    with pytest.raises(AssertionEvalError, match="no numeric value"):
        check("v1.missing > 0")
    with pytest.raises(AssertionEvalError, match="division by zero"):
        check("v1.output_throughput / 0 > 1")


def _run(offline: bool = True, **overrides) -> dict:
    metrics = {
        "num_requests": 8,
        "completed": 8,
        "failed": 0,
        "total_input_tokens": 400,
        "total_output_tokens": 120,
        "num_iterations": 30,
        "total_computed_tokens": 520,
        "total_empty_generation_slots": 0,
        "num_paused_requests": 0,
        "output_throughput": 100.0,
        "request_throughput": 2.0,
        "median_ttft_ms": 40.0,
        "p99_ttft_ms": 80.0,
    }
    metrics.update(overrides)
    return {"offline_arrivals": offline, "variants": {"inflight_fused": {"metrics": metrics}}}


def test_identical_runs_have_no_regressions():
    assert find_regressions(_run(), _run(), 0.1) == []


def test_timings_within_tolerance_pass_and_beyond_it_fail_in_the_direction_that_matters():
    assert find_regressions(_run(), _run(output_throughput=91.0, p99_ttft_ms=87.0), 0.1) == []
    # getting faster is never a regression
    assert find_regressions(_run(), _run(output_throughput=300.0, p99_ttft_ms=10.0), 0.1) == []
    found = find_regressions(_run(), _run(output_throughput=89.0, p99_ttft_ms=89.0), 0.1)
    assert {(r.metric, r.kind) for r in found} == {("output_throughput", "timing"), ("p99_ttft_ms", "timing")}
    assert "11.0% worse" in found[0].message


def test_deterministic_counters_must_match_exactly():
    found = find_regressions(_run(), _run(num_iterations=31), 0.5)
    assert [(r.metric, r.previous, r.current, r.kind) for r in found] == [
        ("num_iterations", 30, 31, "counter")
    ]


def test_engine_counters_are_not_exact_under_timed_arrivals():
    prev, cur = _run(offline=False), _run(offline=False, num_iterations=31)
    assert find_regressions(prev, cur, 0.1) == []
    found = find_regressions(prev, _run(offline=False, total_output_tokens=119), 0.1)
    assert [r.metric for r in found] == ["total_output_tokens"]


def test_variant_missing_from_the_new_run_is_a_regression():
    cur = {"offline_arrivals": True, "variants": {}}
    found = find_regressions(_run(), cur, 0.1)
    assert [(r.variant, r.kind) for r in found] == [("inflight_fused", "missing")]


@pytest.mark.parametrize(("text", "value"), [("10%", 0.1), ("0.1", 0.1), (" 2.5 % ", 0.025), ("0", 0.0)])
def test_tolerance_accepts_percentages_and_fractions(text, value):
    assert parse_tolerance(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["ten", "-5%", "10%%", "1e3", ""])
def test_bad_tolerance_names_the_accepted_forms(text):
    with pytest.raises(ValueError, match="--tolerance"):
        parse_tolerance(text)
