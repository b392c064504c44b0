"""The paired baseline gate: its rule on chosen figures (bm.compare.paired), the runner's alternation
with a stand-in for the baseline's code, the worker protocol with a stand-in process (bm.compare.pairing),
and what a baseline must share with the run it judges (bm.compare.identity)."""

from __future__ import annotations

import json
import math
import sys
import textwrap

import pytest

from bm.compare.identity import gate_identity, identity_differences, refusal
from bm.compare.paired import (
    paired_check,
    paired_rounds_to_settle,
    paired_verdict,
    sign_test_rank,
    unsettled_note,
)
from bm.compare.pairing import BaselineWorker, PairingError, worker_config
from bm.compare.regress import BaselineVerdict, Regression
from bm.compare.runner import run_compare
from bm.compare.variants import plan_variants
from bm.config import load_config
from bm.workloads import arrival_times
from tests.hang import HANG_S
from tests.test_bench_journal import sim_setup

TOL = 0.10


def pairs(baseline, ratios):
    """This run's figures: each baseline figure times its ratio (a latency: > 1 is worse)."""
    return [b * r for b, r in zip(baseline, ratios, strict=True)]


# -- the rule ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "confidence", "k"),
    [(4, 0.95, 0), (5, 0.95, 1), (8, 0.95, 2), (10, 0.95, 2), (20, 0.95, 6), (30, 0.95, 11),
     (9, 0.999, 0), (10, 0.999, 1), (15, 0.999, 2), (20, 0.999, 3)],
)  # fmt: skip
def test_sign_test_rank_is_the_largest_whose_tail_is_within_the_confidence(n, confidence, k):
    assert sign_test_rank(n, confidence) == k
    tail = lambda j: sum(math.comb(n, i) for i in range(j)) / 2**n  # noqa: E731  P(X < j)
    assert tail(k) <= 1 - confidence and (k == n or tail(k + 1) > 1 - confidence)


def test_ten_pairs_worse_than_the_tolerance_are_a_regression_and_five_are_not_yet():
    base = [100.0, 40.0, 250.0, 90.0, 60.0] * 2  # the machine moved 6x from round to round
    check = paired_check("v1", "median_e2el_ms", base, pairs(base, [1.3] * 10), TOL)
    assert check.regressed and check.judged and check.pairs == 10
    assert check.worse_by == pytest.approx(0.3) and check.low == pytest.approx(0.3)
    # five pairs leaning one way are 1 in 32 by chance: too likely among nine timings to fail on
    early = paired_check("v1", "median_e2el_ms", base[:5], pairs(base[:5], [1.3] * 5), TOL)
    assert early.unsettled and early.low == float("-inf") and not early.regressed


def test_a_throughput_is_worse_when_it_falls():
    base = [1000.0, 400.0, 900.0, 700.0, 800.0] * 2
    check = paired_check("v1", "output_throughput", base, [b / 1.3 for b in base], TOL)
    assert check.regressed and check.worse_by == pytest.approx(0.3)


def test_pairs_within_the_tolerance_hold_however_much_the_machine_moved_both_halves():
    base = [100.0, 40.0, 250.0, 90.0, 60.0]
    check = paired_check("v1", "median_e2el_ms", base, pairs(base, [1.02, 0.97, 1.05, 1.0, 0.99]), TOL)
    assert check.judged and not check.regressed and check.high == pytest.approx(0.05)


def test_pairs_whose_bounds_straddle_the_tolerance_are_not_judged_and_not_passed():
    base = [100.0] * 10
    check = paired_check("v1", "median_e2el_ms", base, pairs(base, [1.0, 1.3, 0.9, 1.2, 1.05] * 2), TOL)
    assert check.unsettled and not check.judged and not check.regressed
    assert check.low == pytest.approx(-0.1) and check.high == pytest.approx(0.3)


def test_one_pair_hit_by_a_burst_of_load_does_not_decide():
    base = [100.0] * 10
    ratios = [1.0, 0.98, 1.02, 1.01, 0.99, 3.0, 1.0, 1.03, 0.97, 1.0]  # one half of one pair slowed 3x
    assert paired_check("v1", "p99_e2el_ms", base, pairs(base, ratios), TOL).judged


def test_fewer_than_five_pairs_cannot_settle_and_a_missing_or_zero_figure_is_not_checked():
    assert paired_check("v1", "median_e2el_ms", [1.0] * 4, [1.0] * 4, TOL).unsettled
    assert paired_check("v1", "request_goodput", [1.0, 0.0, 1.0, 1.0, 1.0], [1.0] * 5, TOL) is None
    assert paired_check("v1", "request_goodput", [None] * 5, [None] * 5, TOL) is None


def test_the_gate_measures_more_until_each_timing_settles_or_one_regresses_within_its_bounds():
    base = [100.0] * 10
    held = paired_check("v1", "median_e2el_ms", base, base, TOL)
    open_ = paired_check("v1", "p99_e2el_ms", base, pairs(base, [1.0, 1.3, 0.9, 1.2, 1.05] * 2), TOL)
    worse = paired_check("v1", "median_ttft_ms", base, pairs(base, [1.5] * 10), TOL)
    assert paired_rounds_to_settle(BaselineVerdict([], [held]), 5, 5, 30) == 0
    assert paired_rounds_to_settle(BaselineVerdict([], [held, open_]), 5, 5, 30) == 5
    assert paired_rounds_to_settle(BaselineVerdict([], [held, open_]), 5, 27, 30) == 3
    assert paired_rounds_to_settle(BaselineVerdict([], [held, open_]), 5, 30, 30) == 0
    assert paired_rounds_to_settle(BaselineVerdict([], [open_, worse]), 5, 5, 30) == 0
    note = unsettled_note([held, open_], 42.0)
    assert "1 timing(s) not judged" in note and "v1.p99_e2el_ms, -10.0% to +30.0% worse" in note
    assert "42 s" in note and unsettled_note([held], 1.0) is None


def test_the_paired_verdict_keeps_the_counters_and_replaces_the_saved_timings():
    saved = BaselineVerdict(
        [
            Regression("v1", "num_iterations", 10, 11, "counter", "counter changed"),
            Regression("v1", "output_throughput", 100, 50, "timing", "fell (saved)"),
        ],
        [],
    )
    rounds = [{"output_throughput": 100.0, "median_e2el_ms": 10.0}] * 10
    slowed = [{"output_throughput": 70.0, "median_e2el_ms": 10.0}] * 10
    verdict = paired_verdict(saved, {"v1": (rounds, slowed)}, TOL)
    kinds = [(r.metric, r.kind) for r in verdict.regressions]
    assert kinds == [("num_iterations", "counter"), ("output_throughput", "timing")]
    assert "over 10 paired rounds" in verdict.regressions[1].detail
    assert {c.metric for c in verdict.timing_checks} == {"output_throughput", "median_e2el_ms"}


# -- the runner, with a stand-in for the baseline's code ------------------------------------------------


def test_each_round_pairs_every_variant_with_the_baselines_run_the_order_alternating(tmp_path):
    config, model, workload = sim_setup(tmp_path, **{"bench.num_requests": 4})
    variants = plan_variants("v1,inflight_fused", "guaranteed_no_evict", "")
    order: list[tuple[str, str]] = []

    def theirs(v):
        order.append(("theirs", v.name))
        return {"output_throughput": 1.0}

    result = run_compare(config, model, workload, arrival_times(workload, config.bench), variants,
                         repeat=2, paired=theirs, on_start=lambda v, r, m: order.append(("ours", v.name)))  # fmt: skip
    assert order == [
        ("theirs", "v1"), ("ours", "v1"), ("theirs", "inflight_fused"), ("ours", "inflight_fused"),
        ("ours", "v1"), ("theirs", "v1"), ("ours", "inflight_fused"), ("theirs", "inflight_fused"),
    ]  # fmt: skip
    assert all(len(o.paired) == len(o.repeats) == 2 for o in result.variants)


def test_a_baseline_command_that_fails_mid_comparison_drops_its_pairs_and_the_run_goes_on(tmp_path):
    config, model, workload = sim_setup(tmp_path, **{"bench.num_requests": 4})
    variants = plan_variants("v1,inflight_fused", "guaranteed_no_evict", "")
    calls = []

    def theirs(v):
        calls.append(v.name)
        if len(calls) == 3:
            raise PairingError("the baseline's worker exited (code 1)")
        return {"output_throughput": 1.0}

    result = run_compare(config, model, workload, arrival_times(workload, config.bench), variants,
                         repeat=3, paired=theirs)  # fmt: skip
    assert result.pairing_error == "the baseline's worker exited (code 1)" and len(calls) == 3
    assert result.repeat == 3 and all(len(o.repeats) == 3 and o.paired == [] for o in result.variants)


class Clock:
    """``time.monotonic`` for the runner: one second passes at each reading."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        self.now += 1.0
        return self.now


def test_no_run_starts_after_the_deadline_and_the_round_it_cut_short_is_dropped(tmp_path, monkeypatch):
    config, model, workload = sim_setup(tmp_path, **{"bench.num_requests": 4})
    variants = plan_variants("v1,inflight_fused", "guaranteed_no_evict", "")
    monkeypatch.setattr("bm.compare.runner.time", Clock())
    started = []
    result = run_compare(config, model, workload, arrival_times(workload, config.bench), variants,
                         repeat=5, deadline=6.5, on_start=lambda v, r, m: started.append((r, v.name)))  # fmt: skip
    # readings: 1 (start), then one before each run: 2, 3 (round 0), 4, 5 (round 1), 6, 7 -> stop
    assert started == [(0, "v1"), (0, "inflight_fused"), (1, "v1"), (1, "inflight_fused"), (2, "v1")]
    assert result.timed_out and not result.interrupted and result.repeat == 2
    assert all(len(o.repeats) == 2 for o in result.variants)


# -- the worker protocol, with a stand-in process --------------------------------------------------------

WORKER = """
import json, sys
from pathlib import Path
from bm.compare.pairing import serve
from bm.compare.variants import plan_variants
args = sys.argv[1:]
Path({seen!r}).write_text(json.dumps(args))
schemes = args[args.index("--schemes") + 1]
runs = iter(range(1, 1000))
serve(plan_variants(schemes, "guaranteed_no_evict"), lambda v: {{"output_throughput": float(next(runs))}},
      sys.stdin, sys.stdout, "9.9-test")
"""


def baseline_doc(tmp_path, names=("v1", "inflight_fused")):
    config = load_config(None, {"model.config": "tiny.json", "bench.dataset_kind": "synthetic"}).to_dict()
    variants = {
        n: {"kind": "bm", "batching_scheme": n, "scheduler_policy": "guaranteed_no_evict"} for n in names
    }
    return {"config": config, "variants": variants}


def worker_command(tmp_path, body=WORKER):
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(body.format(seen=str(tmp_path / "argv.json"))))
    return f"{sys.executable} {script}"


def test_the_worker_runs_one_variant_per_request_and_ends_when_its_input_closes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.json").write_text("{}")
    variants = plan_variants("v1,inflight_fused", "guaranteed_no_evict")
    worker = BaselineWorker.spawn(worker_command(tmp_path), baseline_doc(tmp_path))
    try:
        worker.ready(variants, timeout_s=HANG_S)
        assert worker.bm_version == "9.9-test" and worker.variants == ["v1", "inflight_fused"]
        assert worker.run(variants[1]) == {"output_throughput": 1.0}
        assert worker.run(variants[0]) == {"output_throughput": 2.0}
    finally:
        worker.close()
    assert worker.process.returncode == 0
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[:2] == ["compare", "--pair-worker"] and "--schemes" in argv


def test_the_worker_reads_the_baselines_config_with_its_files_found_from_here(tmp_path):
    (tmp_path / "tiny.json").write_text("{}")
    data = worker_config(
        {"model": {"config": "tiny.json", "path": None}, "bench": {"dataset": "gone.jsonl"}}, tmp_path
    )
    assert data["model"]["config"] == str(tmp_path / "tiny.json")
    assert data["bench"]["dataset"] == "gone.jsonl"  # not here: left for the worker to report


def test_an_older_bm_without_the_worker_is_reported_in_its_own_words(tmp_path):
    old = worker_command(
        tmp_path, "import sys\nprint('Error: No such option: --pair-worker', file=sys.stderr)\nsys.exit(2)\n"
    )
    worker = BaselineWorker.spawn(old, baseline_doc(tmp_path))
    with pytest.raises(PairingError, match=r"exited \(code 2\).*No such option: --pair-worker"):
        worker.ready(plan_variants("v1,inflight_fused", "guaranteed_no_evict"), timeout_s=HANG_S)


def test_a_worker_that_runs_other_variants_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    worker = BaselineWorker.spawn(worker_command(tmp_path), baseline_doc(tmp_path, names=("v1",)))
    with pytest.raises(PairingError, match="runs v1, not this run's v1, inflight_fused"):
        worker.ready(plan_variants("v1,inflight_fused", "guaranteed_no_evict"), timeout_s=HANG_S)
    assert worker.process.returncode is not None


def test_a_command_that_does_not_exist_cannot_pair(tmp_path):
    with pytest.raises(PairingError, match="could not start"):
        BaselineWorker.spawn(str(tmp_path / "no-such-bm"), baseline_doc(tmp_path))


# -- what a baseline must share ----------------------------------------------------------------------------


def identity(sets=None, schemes="v1,inflight_fused", digest=None):
    base = {"bench.dataset_kind": "synthetic", "bench.num_requests": 64, "model.config": "tiny.json"}
    config = load_config(None, base | (sets or {}))
    return config, gate_identity(config, plan_variants(schemes, "guaranteed_no_evict"), digest)


def saved_doc(config, ident):
    return {
        "config": config.to_dict(),
        "identity": ident,
        "variants": {name: {} for name in ident["variants"]},
    }


def test_the_same_run_has_no_differences_and_its_digest_ignores_each_variants_scheme():
    config, mine = identity()
    _, other_scheme = identity({"engine.batching_scheme": "v1"})
    assert identity_differences(saved_doc(config, mine), mine) == []
    assert other_scheme["config_sha256"] == mine["config_sha256"]


def test_another_workload_config_or_set_of_variants_is_named_difference_by_difference():
    config, theirs = identity()
    _, mine = identity({"bench.num_requests": 32, "engine.max_batch_size": 16}, schemes="inflight_fused")
    found = identity_differences(saved_doc(config, theirs), mine)
    assert found == [
        "another set of variants: the baseline compared v1, inflight_fused, this run compares "
        "inflight_fused (only the baseline has v1)",
        "another workload: bench.num_requests is 64 in the baseline, 32 here",
        "another config: engine.max_batch_size is null in the baseline, 16 here",
    ]
    text = refusal("base/compare.json", found)
    assert text.startswith("--baseline base/compare.json cannot judge this run") and "bm compare" in text


def test_another_dataset_file_under_the_same_name_is_another_workload():
    config, theirs = identity(digest="a" * 64)
    _, mine = identity(digest="b" * 64)
    assert identity_differences(saved_doc(config, theirs), mine) == [
        "another workload: the dataset file's contents differ (sha256 aaaaaaaaaaaa... in the baseline, "
        "bbbbbbbbbbbb... here)"
    ]


def test_a_key_the_baselines_bm_did_not_know_is_the_same_run_when_left_at_its_default():
    config, theirs = identity()
    del theirs["config"]["engine.max_num_active_requests"]  # an older bm, before the key existed
    theirs["config_sha256"] = "older"
    _, mine = identity()
    assert identity_differences(saved_doc(config, theirs), mine) == []
    _, set_here = identity({"engine.max_num_active_requests": 4})
    assert identity_differences(saved_doc(config, theirs), set_here) == [
        "another config: engine.max_num_active_requests is 4 here, unknown to the baseline's bm"
    ]


def test_an_older_baseline_without_identity_is_compared_on_the_keys_this_run_sets():
    config, mine = identity({"engine.max_batch_size": 8})
    resolved = config.to_dict()
    resolved["kv_cache"]["max_tokens"] = 4096  # sized at run time: this run leaves it unset
    old = {"config": resolved, "variants": {name: {} for name in mine["variants"]}}
    assert identity_differences(old, mine) == []
    _, other = identity({"engine.max_batch_size": 16})
    assert identity_differences(old, other) == [
        "another config: engine.max_batch_size is 8 in the baseline, 16 here"
    ]


def test_a_baseline_naming_no_variants_names_none():
    _, mine = identity()
    found = identity_differences({"variants": {}}, mine)
    assert found[0].startswith("another set of variants: the baseline compared none")
