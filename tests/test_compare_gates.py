"""The CI gates of ``bm compare``: the --assert grammar (never eval) and --baseline regression checks."""

from __future__ import annotations

import builtins

import pytest

from bm.bench.tally import StatsTally
from bm.compare.expr import (
    AssertionEvalError,
    AssertionSyntaxError,
    check_refs,
    evaluate_assertion,
    parse_assertion,
)
from bm.compare.load import QUIET_SHARE, is_quiet
from bm.compare.regress import (
    EXACT_IF_OFFLINE,
    ToleranceError,
    busy_machine_note,
    find_regressions,
    judge,
    kv_block_counters,
    parse_noise_factor,
    parse_tolerance,
    rounds_to_settle,
    slow_baseline_note,
    summarize_timing,
)
from bm.cpu_load import CpuTicks, background_share, read_ticks

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


def _timed(metric: str, values: list[float], offline: bool = True) -> dict:
    """A compare.json whose one variant measured ``values`` of ``metric`` over its repeats."""
    doc = _run(offline)
    summary = summarize_timing(metric, values)
    doc["variants"]["inflight_fused"]["timings"] = {metric: summary.to_dict()}
    return doc


def test_timing_judged_on_the_best_repeat_with_the_median_repeat_as_its_noise():
    # a burst of load slowed two repeats of five: the best is the machine's speed, the median 5% off it
    summary = summarize_timing("output_throughput", [100.0, 40.0, 98.0, 35.0, 95.0])
    assert (summary.best, summary.median, summary.low, summary.high) == (100.0, 95.0, 35.0, 100.0)
    assert summary.spread == pytest.approx(0.05)
    # many repeats: the two fastest agree by construction, the median says how much a repeat moves
    many = summarize_timing("median_ttft_ms", [9.6, 9.7, 18.0, 18.3, 19.0, 17.5, 20.0, 18.4, 18.1, 9.9])
    assert many.spread == pytest.approx((18.05 - 9.6) / 9.6)
    latency = summarize_timing("p99_ttft_ms", [50.0, 200.0, 55.0])
    assert (latency.best, latency.spread) == (50.0, pytest.approx(0.1))
    assert summarize_timing("output_throughput", [100.0]).spread == 0.0
    assert summarize_timing("p99_ttft_ms", [50.0, None]) is None  # a metric not measured every repeat


def test_quiet_runs_are_held_to_the_tolerance_and_a_30_percent_slowdown_fails():
    prev = _timed("median_e2el_ms", [1000.0, 1010.0, 1020.0])  # a typical repeat: 1010
    # unchanged code: its typical repeat is the baseline's
    verdict = judge(prev, _timed("median_e2el_ms", [1030.0, 1040.0, 1005.0]), 0.1)
    assert verdict.regressions == []
    [check] = [c for c in verdict.timing_checks if c.metric == "median_e2el_ms"]
    assert check.margin == pytest.approx(0.1) and check.worse_by == pytest.approx(20 / 1010)
    # every iteration 1.3x as long
    slowed = judge(prev, _timed("median_e2el_ms", [1300.0, 1313.0, 1330.0]), 0.1)
    [r] = slowed.regressions
    assert (r.metric, r.kind, r.previous, r.current) == ("median_e2el_ms", "timing", 1010.0, 1313.0)
    assert "median of 3 -> median of 3; 30.0% worse, margin 10.0% = tolerance" in r.message
    # throughput falls to 1/1.3 (23% lower)
    prev_tp = _timed("output_throughput", [500.0, 495.0, 490.0])
    [r] = judge(prev_tp, _timed("output_throughput", [385.0, 380.7, 376.0]), 0.1).regressions
    assert r.metric == "output_throughput" and "23.1% worse" in r.message  # median against median


def test_noisy_runs_widen_the_margin_to_the_noise_they_measured_and_report_it():
    prev = _timed("output_throughput", [500.0, 400.0, 300.0])  # the median repeat 20% off the best
    verdict = judge(prev, _timed("output_throughput", [290.0, 280.0, 270.0]), 0.1, noise_factor=2.0)
    assert verdict.regressions == []  # 30% under the median, within 2 x 20% of measured noise
    assert verdict.widest_margin() == pytest.approx(0.4)
    [r] = judge(prev, _timed("output_throughput", [205.0, 200.0, 195.0]), 0.1, noise_factor=2.0).regressions
    assert "50.0% worse, margin 40.0% = 2 x measured noise 20.0%" in r.message


def test_noise_factor_zero_with_one_repeat_is_the_fixed_tolerance_rule():
    prev = _timed("output_throughput", [500.0])
    assert judge(prev, _timed("output_throughput", [440.0]), 0.1, noise_factor=0).regressions != []
    assert judge(prev, _timed("output_throughput", [460.0]), 0.1, noise_factor=0).regressions == []


def test_a_run_with_fewer_quiet_repeats_than_the_baseline_is_held_to_its_typical_repeat_not_its_best():
    """The best of ten repeats beats the best of three from the same spread: holding this run's best
    to the baseline's best failed unchanged code (13-14% worse beside an on/off busy loop)."""
    prev = _timed("output_throughput", [22330.0, 21000.0, 20800.0, 20500.0, 20400.0, 20300.0, 20100.0])
    unchanged = judge(prev, _timed("output_throughput", [19420.0, 19000.0]), 0.1, noise_factor=1.0)
    assert unchanged.regressions == []  # 13% under the baseline's best, 6.4% under its median
    slowed = judge(prev, _timed("output_throughput", [15700.0, 15600.0]), 0.1, noise_factor=1.0)
    assert [r.metric for r in slowed.regressions] == ["output_throughput"]  # 1/1.3 of the median


def test_thirty_repeats_of_a_slowed_run_cannot_pass_on_a_lucky_one():
    """The median, not the best: the more repeats a slowed run takes, the surer its typical figure,
    where its best only gets luckier (a planted 30% slowdown passed that way beside a busy loop)."""
    prev = _timed(
        "output_throughput", [22878.0, 19620.0, 19516.0, 20422.0, 20845.0, 18166.0, 18320.0, 19456.0]
    )
    slowed = [
        12724.0,
        13199.0,
        13784.0,
        13924.0,
        14131.0,
        14332.0,
        14349.0,
        14432.0,
        15765.0,
        16214.0,
        16600.0,
        16994.0,
    ]
    [r] = [r for r in judge(prev, _timed("output_throughput", slowed), 0.1).regressions]
    assert r.metric == "output_throughput" and "median of 8 -> median of 12" in r.message


def test_the_gate_re_measures_before_it_reports_and_when_noise_hides_the_tolerance():
    quiet = _timed("output_throughput", [500.0, 495.0])
    settled = judge(quiet, _timed("output_throughput", [498.0, 490.0]), 0.1)
    assert rounds_to_settle(settled, 0.1, 2.0, repeat=5, done=5, most=15) == 0
    suspect = judge(quiet, _timed("output_throughput", [300.0, 295.0]), 0.1)
    assert rounds_to_settle(suspect, 0.1, 2.0, repeat=5, done=5, most=15) == 5
    assert rounds_to_settle(suspect, 0.1, 2.0, repeat=5, done=12, most=15) == 3
    assert rounds_to_settle(suspect, 0.1, 2.0, repeat=5, done=15, most=15) == 0
    # nothing regressed, but this run's noise (median 15% off) widened the margin past the tolerance
    noisy = judge(quiet, _timed("output_throughput", [520.0, 364.0]), 0.1)
    assert noisy.regressions == [] and rounds_to_settle(noisy, 0.1, 2.0, 5, 5, 15) == 5
    # the baseline's own noise is not something more rounds of this run can fix
    noisy_base = judge(
        _timed("output_throughput", [500.0, 350.0]), _timed("output_throughput", [498.0, 495.0]), 0.1
    )
    assert rounds_to_settle(noisy_base, 0.1, 2.0, 5, 5, 15) == 0


@pytest.mark.parametrize("metric", EXACT_IF_OFFLINE)
def test_every_deterministic_counter_is_compared_exactly_and_named(metric):
    prev, cur = _run(**{metric: 7}), _run(**{metric: 8})
    found = find_regressions(prev, cur, tolerance=100.0)  # no timing tolerance can excuse a counter
    assert [(r.metric, r.kind, r.previous, r.current) for r in found] == [(metric, "counter", 7, 8)]
    assert f"inflight_fused.{metric}: counter changed 7 -> 8 (must match exactly)" == found[0].message


def test_kv_block_counters_read_the_peak_and_the_sum_of_used_blocks():
    tally = StatsTally()
    for n in (3, 9, 4):
        tally.add({"Used KV cache blocks": n})
    assert kv_block_counters(tally) == {"max_used_kv_blocks": 9, "total_used_kv_block_iterations": 16}
    assert kv_block_counters(StatsTally()) == {"max_used_kv_blocks": 0, "total_used_kv_block_iterations": 0}


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_bad_noise_factor_names_the_accepted_values(value):
    with pytest.raises(ToleranceError, match="--noise-factor"):
        parse_noise_factor(value)


def test_a_baseline_beaten_beyond_its_margins_is_called_out_as_possibly_loaded():
    loaded_base = _timed("output_throughput", [100.0, 98.0])
    verdict = judge(loaded_base, _timed("output_throughput", [1000.0, 990.0]), 0.1)
    assert verdict.regressions == []  # one-sided: never a failure
    note = slow_baseline_note(verdict.timing_checks)
    assert "inflight_fused.output_throughput 99 -> 995" in note and "save it again" in note
    assert (
        slow_baseline_note(judge(loaded_base, _timed("output_throughput", [105.0, 100.0]), 0.1).timing_checks)
        is None
    )


# -- the load meter: timings are judged on the repeats that had the machine to themselves ----------------


def _fake_proc(root, busy: tuple[int, ...], idle: int, own: tuple[int, int]):
    """A /proc with the machine's tick counts (user nice system, then irq softirq steal) and this
    process's utime/stime, its name holding a space and a parenthesis as real names may."""
    user, nice, system, irq, softirq, steal = busy
    (root / "self").mkdir(parents=True, exist_ok=True)
    (root / "stat").write_text(
        f"cpu  {user} {nice} {system} {idle} 0 {irq} {softirq} {steal} 0 0\ncpu0 1 2 3\n"
    )
    rest = " ".join(["S", *["0"] * 10, str(own[0]), str(own[1]), *["0"] * 30])
    (root / "self" / "stat").write_text(f"4242 (bm (worker) 1) {rest}\n")
    return read_ticks(root)


def test_the_load_meter_counts_the_ticks_other_processes_took(tmp_path):
    before = _fake_proc(tmp_path, (1000, 0, 100, 0, 0, 0), idle=5000, own=(50, 10))
    assert before == CpuTicks(busy=1100, total=6100, own=60)
    # 200 ticks pass on the machine: this process took 120 of them, others 50 (10 of it stolen), 30 idle
    after = _fake_proc(tmp_path, (1140, 0, 120, 0, 0, 10), idle=5030, own=(160, 20))
    assert background_share(before, after) == pytest.approx(50 / 200)
    assert background_share(before, before) is None  # no time passed
    assert background_share(None, after) is None
    assert read_ticks(tmp_path / "missing") is None  # not Linux: unknown, every repeat counts as quiet
    assert is_quiet(None) and is_quiet(QUIET_SHARE) and not is_quiet(QUIET_SHARE + 0.01)


def _timed_under(metric: str, values: list[float], shares: list[float | None]) -> dict:
    doc = _run()
    summary = summarize_timing(metric, values, shares)
    doc["variants"]["inflight_fused"]["timings"] = {metric: summary.to_dict()}
    return doc


def test_a_repeat_slowed_by_other_processes_is_left_out_of_the_figures():
    summary = summarize_timing("output_throughput", [100.0, 30.0, 96.0, 98.0], [0.0, 0.5, 0.01, 0.02])
    assert (summary.best, summary.median, summary.quiet, summary.busiest) == (100.0, 98.0, 3, 0.5)
    assert summary.repeats == 4 and summary.judgeable
    loaded = summarize_timing("output_throughput", [40.0, 30.0], [0.5, 0.45])
    assert (loaded.best, loaded.quiet, loaded.judgeable) == (40.0, 0, False)
    assert summarize_timing("output_throughput", [40.0], None).judgeable  # an older bm measured no load


def test_a_run_slowed_by_a_busy_machine_is_not_called_a_regression_and_says_why():
    prev = _timed_under("output_throughput", [500.0, 495.0], [0.0, 0.01])
    busy = judge(prev, _timed_under("output_throughput", [150.0, 160.0], [0.5, 0.48]), 0.1)
    assert busy.regressions == []
    [check] = [c for c in busy.timing_checks if c.metric == "output_throughput"]
    assert not check.judged and check.busy_side == "this run" and check.busy_share == 0.5
    assert not check.improved and busy.widest_margin() == pytest.approx(0.1)  # the others' margin
    note = busy_machine_note(busy.timing_checks)
    assert "1 timing(s) not judged" in note and "up to 50%" in note and "--max-repeat" in note
    # more rounds may find a quiet spell
    assert rounds_to_settle(busy, 0.1, 1.0, repeat=5, done=5, most=15) == 5
    # a baseline saved on a busy machine cannot be judged against: re-save it, more rounds cannot help
    stale = judge(_timed_under("output_throughput", [150.0], [0.6]), prev, 0.1)
    assert stale.regressions == [] and "save the baseline again" in busy_machine_note(stale.timing_checks)
    assert rounds_to_settle(stale, 0.1, 1.0, repeat=5, done=5, most=15) == 0


def test_a_slowdown_is_caught_on_the_quiet_repeats_of_a_partly_busy_run():
    prev = _timed_under("output_throughput", [500.0, 495.0, 200.0], [0.0, 0.01, 0.6])
    slowed = _timed_under("output_throughput", [382.0, 378.0, 150.0, 120.0], [0.02, 0.0, 0.55, 0.7])
    [r] = judge(prev, slowed, 0.1).regressions  # quiet medians: 497.5 -> 380
    assert r.metric == "output_throughput" and "23.6% worse" in r.message
