"""``bm compare --baseline`` as a CI gate on the command line: a baseline that cannot judge the run is
refused before the model loads, a gate that cannot judge a timing exits 4 (not 0), it stops measuring at
--time-limit, and --baseline-cmd pairs every run with one of the baseline's code in a worker process."""

from __future__ import annotations

import json
import re
import shlex
import sys

import pytest
from typer.testing import CliRunner

from bm.cli.exit_codes import NOT_JUDGED
from bm.cli.main import app
from tests.conftest import compare_dataset
from tests.test_compare import _planted_slowdown
from tests.test_compare_paired import Clock

runner = CliRunner()


@pytest.fixture(scope="module", autouse=True)
def judge_every_repeat():
    """As in test_compare.py: the load meter reads nothing here, so every repeat counts as quiet unless
    a test says otherwise."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("bm.compare.runner.read_ticks", lambda: None)
        yield


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return compare_dataset(tmp_path_factory.mktemp("data"))


def compare(dataset, out, *extra):
    args = ["compare", str(dataset), "-o", str(out), "--ignore-eos", "--quiet", "--set", "model.device=cpu"]
    return runner.invoke(app, [*args, "--schemes", "inflight_fused", *map(str, extra)])


@pytest.fixture(scope="module")
def saved(dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("base")
    result = compare(dataset, out, "--repeat", "2")
    assert result.exit_code == 0, result.output
    return out / "compare.json"


def flat(result):
    return " ".join(result.output.split())


def test_a_baseline_of_another_workload_or_variants_is_refused_before_the_model_loads(
    saved, dataset, tmp_path, monkeypatch
):
    def no_load(*args):
        raise AssertionError("the model must not load for a baseline that cannot judge the run")

    monkeypatch.setattr("bm.cli.compare.load_model_and_workload", no_load)
    result = compare(dataset, tmp_path / "n", "--baseline", saved, "--num-requests", "3")
    assert result.exit_code == 2, result.output
    assert "another workload: bench.num_requests is null in the baseline, 3 here" in flat(result)
    result = runner.invoke(app, ["compare", str(dataset), "-o", str(tmp_path / "v"), "--ignore-eos", "--set",
                                 "model.device=cpu", "--schemes", "v1,inflight_fused", "--baseline", str(saved)])  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "another set of variants" in flat(result) and "only this run has v1" in flat(result)
    assert not (tmp_path / "n").exists() and not (tmp_path / "v").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--baseline-cmd", "bm"],
            "--baseline-cmd runs the baseline's code beside this run's: give --baseline",
        ),
        (["--time-limit", "0"], "--time-limit 0.0: give the seconds of measuring"),
    ],
)
def test_gate_flags_are_checked_before_the_model_loads(dataset, tmp_path, args, message):
    result = compare(dataset, tmp_path / "out", *args)
    assert result.exit_code == 2 and message in flat(result)


def test_a_gate_that_cannot_judge_a_timing_exits_4_unless_allowed(saved, dataset, tmp_path, monkeypatch):
    monkeypatch.setattr("bm.compare.runner.background_share", lambda before, after: 0.9)  # never alone
    gate = ["--baseline", saved, "--repeat", "2", "--max-repeat", "2", "--tolerance", "10000%"]
    result = compare(dataset, tmp_path / "busy", *gate)
    assert result.exit_code == NOT_JUDGED == 4, result.output
    assert "not judged" in flat(result) and "--allow-unjudged passes it" in flat(result)
    assert "no regressions" not in flat(result)
    doc = json.loads((tmp_path / "busy" / "compare.json").read_text())
    assert doc["baseline"]["timings_from"] == "saved" and not any(
        c["judged"] for c in doc["baseline"]["timing_checks"]
    )
    allowed = compare(dataset, tmp_path / "allowed", *gate, "--allow-unjudged")
    assert allowed.exit_code == 0, allowed.output
    assert "no regressions" in flat(allowed) and "not judged, allowed" in flat(allowed)


@pytest.mark.parametrize(
    ("repeat", "limit", "rounds"),
    [
        # the clock starts at 1 (deadline 4.5); the runner reads 2 at its start, 3 and 4 before two
        # runs, then 5: the third round is cut before it starts
        (5, 3.5, 2),
        # deadline 3.5: one round (read 3), then the gate asks for more at 4: past the limit
        (1, 2.5, 1),
    ],
)
def test_the_gate_stops_measuring_at_its_time_limit(
    saved, dataset, tmp_path, monkeypatch, repeat, limit, rounds
):
    clock = Clock()  # one second passes at each reading, for the gate and the runner alike
    monkeypatch.setattr("bm.compare.runner.time", clock)
    monkeypatch.setattr("bm.cli.compare_gate.time", clock)
    monkeypatch.setattr("bm.compare.runner.background_share", lambda before, after: 0.9)
    result = compare(
        dataset, tmp_path / "bound", "--baseline", saved, "--repeat", repeat, "--time-limit", limit
    )
    assert result.exit_code == NOT_JUDGED, result.output
    assert f"--time-limit reached after {rounds} round(s)" in flat(result)
    doc = json.loads((tmp_path / "bound" / "compare.json").read_text())
    assert doc["timed_out"] and doc["repeat"] == rounds


def test_the_paired_gate_runs_the_baseline_command_beside_this_run_and_catches_a_slowdown_of_this_side(
    saved, dataset, tmp_path
):
    command = (
        f"{shlex.quote(sys.executable)} -m bm"  # the same code: the planted slowdown is this side's only
    )
    result = compare(dataset, tmp_path / "same", "--baseline", saved, "--baseline-cmd", command,
                     "--tolerance", "10000%")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "paired with the baseline's code" in flat(result)
    doc = json.loads((tmp_path / "same" / "compare.json").read_text())
    assert doc["baseline"]["timings_from"] == "paired" and doc["baseline"]["command"] == command
    # five pairs are the fewest that can hold; on a loaded runner one pair's ratio can pass even this
    # tolerance (a stall on one side of a millisecond timing), and the gate then measures more rounds
    rounds = doc["repeat"]
    assert rounds >= 5 and f"{rounds} paired round(s)" in flat(result)
    assert len(doc["variants"]["inflight_fused"]["paired_baseline_per_repeat"]) == rounds
    assert all(c["pairs"] == rounds and c["judged"] for c in doc["baseline"]["timing_checks"])

    # every engine step of this side 1 s longer (these runs take well under a second in all); the
    # baseline's side runs in its own process, untouched
    with _planted_slowdown()(0.0, extra_s=1.0):
        result = compare(dataset, tmp_path / "slow", "--baseline", saved, "--baseline-cmd", command,
                         "--tolerance", "100%")  # fmt: skip
    assert result.exit_code == 1, result.output
    doc = json.loads((tmp_path / "slow" / "compare.json").read_text())
    found = doc["baseline"]["regressions"]
    # ten pairs are the fewest that can show a regression; a pair the load evened out adds rounds
    rounds = doc["repeat"]
    assert {r["kind"] for r in found} == {"timing"} and rounds >= 10
    assert re.search(
        rf"regression: inflight_fused\.\w+: (rose|fell) .* over {rounds} paired rounds", flat(result)
    )


def test_a_baseline_command_that_cannot_pair_falls_back_to_the_saved_timings_and_says_so(
    saved, dataset, tmp_path
):
    command = f"{shlex.quote(sys.executable)} -c 'import sys; sys.exit(\"no pairing here\")'"
    result = compare(dataset, tmp_path / "old", "--baseline", saved, "--baseline-cmd", command,
                     "--repeat", "2", "--max-repeat", "2", "--tolerance", "10000%")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "not paired" in flat(result) and "no pairing here" in flat(result)
    gate = json.loads((tmp_path / "old" / "compare.json").read_text())["baseline"]
    assert gate["timings_from"] == "saved" and "no pairing here" in gate["pairing_error"]


def test_a_paired_gate_measures_until_its_time_limit_and_saved_timings_until_six_times_repeat():
    from types import SimpleNamespace

    from bm.cli.compare_gate import Gate

    gate = Gate({}, "base.json", 0.1, 1.0, repeat=5, most=None, time_limit=300.0, simulated=False)
    result = SimpleNamespace(pairing_error=None)
    assert gate.rounds_cap(result) == 30  # no worker: saved timings
    gate.worker = SimpleNamespace()
    assert gate.rounds_cap(result) == sys.maxsize  # paired: every pair narrows the bounds
    assert gate.rounds_cap(SimpleNamespace(pairing_error="the worker died")) == 30
    gate.most = 12
    assert gate.rounds_cap(result) == 12  # --max-repeat, whatever is judged
