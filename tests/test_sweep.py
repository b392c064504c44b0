"""``bm sweep``: the SLO search finds the highest feasible load (deterministic under the simulator),
resumes without rerunning a finished point, runs points in parallel with the same answer, and gates.

Every test runs a tiny generated workload under the simulator (no ../shared, no model weights)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from bm.cli.main import app
from bm.config import ConfigError, load_config
from bm.sweep import runner as sweep_runner
from bm.sweep.grid import expand, plan_axes
from bm.sweep.runner import PointStore, SweepPlan, load_config_for, run_sweep
from bm.sweep.search import LoadSearch, Slo

MODEL = Path(__file__).resolve().parents[1] / "configs" / "models" / "llama-3.1-8b.json"
SLO_FLAGS = "ttft=400,tpot=40"


def base_overrides(**sets: object) -> dict[str, object]:
    return {
        "engine.executor": "sim",
        "sim.hardware": "h100-sxm",
        "model.config": str(MODEL),
        "engine.enable_chunked_context": True,
        "bench.dataset_kind": "synthetic",
        "bench.num_requests": 60,
        "bench.input_len": 512,
        "bench.output_len": 48,
        "bench.range_ratio": 0.5,
        "bench.seed": 5,
        **sets,
    }


def sweep_inputs(schemes: str = "inflight_fused", **sets: object):
    from bm.bench.simulated import load_sim_model
    from bm.workloads import load_workload

    base = load_config(None, base_overrides(**sets))
    configs = expand(base, plan_axes(None, {"engine.batching_scheme": schemes}))
    model = load_sim_model(base)
    workload = load_workload(base.bench, vocab_size=model.vocab_size, encode=None)
    return configs, model, workload


def load_workload_for(config, model):
    from bm.workloads import load_workload

    return load_workload(config.bench, vocab_size=model.vocab_size, encode=None)


def replay(config, model, workload, slo: Slo, rate: float) -> bool:
    """Feasibility of one full replay at ``rate`` (no early stop)."""
    from bm.bench.simulated import run_sim

    result = run_sim(load_config_for(config, "rate", rate), model, workload)
    return slo.feasible(slo.values(result.requests), int(result.metrics["failed"]))


# -- the search ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("threshold", [0.7, 3.0, 37.5, 1000.0])
def test_the_search_brackets_then_bisects_to_the_stated_precision(threshold):
    search = LoadSearch(start=4.0, precision=0.05)
    while (load := search.next_load()) is not None:
        search.record(load, load <= threshold)
    assert search.feasible_at is not None and search.feasible_at <= threshold
    assert search.infeasible_at is not None and search.infeasible_at > threshold
    assert search.infeasible_at <= search.feasible_at * 1.05
    assert len(search.tried) <= 14


def test_a_concurrency_search_ends_on_adjacent_integers():
    search = LoadSearch(start=16.0, integer=True)
    while (load := search.next_load()) is not None:
        search.record(load, load <= 23)
    assert (search.feasible_at, search.infeasible_at) == (23.0, 24.0)


@pytest.mark.parametrize("n", [1, 7, 100, 2000])
def test_more_misses_than_allowed_put_the_percentile_above_the_limit(n):
    slo = Slo({"ttft": 10.0}, 99.0)
    allowed = slo.allowed_misses(n)
    values = pd.Series([1.0] * (n - allowed - 1) + [100.0] * (allowed + 1))
    assert values.quantile(0.99) > 10.0


def test_an_unknown_slo_metric_is_refused_naming_the_choices():
    with pytest.raises(ConfigError, match="unknown SLO metric 'ttfb'; use ttft, tpot, itl, e2el"):
        Slo.parse(["ttfb=5"], 99)


# -- the answer is right ---------------------------------------------------------------------------------


def test_the_reported_highest_rate_meets_the_slo_and_ten_percent_more_misses_it(tmp_path):
    configs, model, workload = sweep_inputs()
    slo = Slo.parse([SLO_FLAGS], 99)
    plan = SweepPlan(configs, slo, precision=0.05, workers=1)
    (outcome,) = run_sweep(plan, model, workload, PointStore(tmp_path))
    assert outcome.max_load is not None
    assert replay(configs[0].config, model, workload, slo, outcome.max_load)
    assert not replay(configs[0].config, model, workload, slo, round(outcome.max_load * 1.1, 6))


def test_early_stop_never_changes_the_answer(tmp_path):
    configs, model, workload = sweep_inputs()
    slo = Slo.parse([SLO_FLAGS], 99)
    answers = []
    for early in (True, False):
        plan = SweepPlan(configs, slo, workers=1, early_stop=early)
        (outcome,) = run_sweep(plan, model, workload, PointStore(tmp_path / str(early)))
        answers.append((outcome.max_load, [(p.load, p.feasible) for p in outcome.points]))
    assert answers[0] == answers[1]


def test_parallel_workers_find_the_same_loads_as_one(tmp_path):
    configs, model, workload = sweep_inputs("inflight,inflight_fused")
    slo = Slo.parse([SLO_FLAGS], 99)
    found = []
    for workers in (1, 2):
        plan = SweepPlan(configs, slo, workers=workers)
        outcomes = run_sweep(plan, model, workload, PointStore(tmp_path / str(workers)))
        found.append({o.name: (o.max_load, len(o.points)) for o in outcomes})
    assert found[0] == found[1]


def test_a_parallel_sweep_loads_every_simulated_model_before_its_workers_fork(tmp_path, monkeypatch):
    """A local row's forward fit is measured in the parent, once per row, never by a forked worker
    (CUDA cannot start again in a forked child, and workers measuring at once would skew each other)."""
    import os

    import bm.bench.simulated

    base = load_config(None, base_overrides(**{"bench.num_requests": 12}))
    configs = expand(base, plan_axes(None, {"sim.hardware": "h100-sxm,h200"}))
    model = bm.bench.simulated.load_sim_model(base)
    workload = load_workload_for(base, model)
    loads = tmp_path / "loads"
    real = bm.bench.simulated.load_sim_model

    def recording(config):
        with loads.open("a") as f:
            f.write(f"{os.getpid()} {config.sim.hardware}\n")
        return real(config)

    monkeypatch.setattr(bm.bench.simulated, "load_sim_model", recording)
    monkeypatch.setattr(sweep_runner, "_SHARED", {})
    run_sweep(
        SweepPlan(configs, Slo.parse([SLO_FLAGS], 99), workers=2), model, workload, PointStore(tmp_path)
    )
    loaded = [line.split() for line in loads.read_text().splitlines()]
    assert sorted(hw for _, hw in loaded) == ["h100-sxm", "h200"]
    assert {int(pid) for pid, _ in loaded} == {os.getpid()}


# -- resume ----------------------------------------------------------------------------------------------


def test_a_resumed_sweep_reruns_no_finished_point(tmp_path, monkeypatch):
    configs, model, workload = sweep_inputs()
    plan = SweepPlan(configs, Slo.parse([SLO_FLAGS], 99), workers=1)
    (full,) = run_sweep(plan, model, workload, PointStore(tmp_path))
    lines = (tmp_path / "points.jsonl").read_text().splitlines()
    (tmp_path / "points.jsonl").write_text("\n".join(lines[:2]) + "\n")  # interrupted after two points

    ran: list[float] = []
    real = sweep_runner.run_point

    def counting(grid, kind, load, *rest):
        ran.append(load)
        return real(grid, kind, load, *rest)

    monkeypatch.setattr(sweep_runner, "run_point", counting)
    (resumed,) = run_sweep(plan, model, workload, PointStore(tmp_path))
    finished = {json.loads(line)["load"] for line in lines[:2]}
    assert ran and not finished & set(ran)
    assert len(ran) == len(lines) - 2
    assert resumed.max_load == full.max_load
    ran.clear()
    run_sweep(plan, model, workload, PointStore(tmp_path))
    assert ran == []


# -- the command: outputs, gates, resume identity ---------------------------------------------------------


def cli(tmp_path: Path, *extra: str) -> object:
    sets = [f"--set={k}={v}" for k, v in base_overrides().items()]
    args = ["sweep", *sets, "--schemes", "inflight,inflight_fused", "--slo", SLO_FLAGS, "--workers", "1"]
    return CliRunner().invoke(app, [*args, "-o", str(tmp_path / "out"), "--no-plot", *extra])


def test_sweep_writes_its_files_and_passes_a_true_gate(tmp_path):
    done = cli(tmp_path, "--assert", "inflight_fused.max_load >= inflight.max_load")
    assert done.exit_code == 0, done.output
    out = tmp_path / "out"
    document = json.loads((out / "sweep.json").read_text())
    assert set(document["configs"]) == {"inflight", "inflight_fused"}
    header = (out / "sweep.csv").read_text().splitlines()[0].split(",")
    assert {"config", "load", "feasible", "output_throughput", "p99_ttft_ms"} <= set(header)
    assert "passed: inflight_fused.max_load >= inflight.max_load" in done.output


def test_a_false_gate_and_a_regression_against_the_baseline_exit_1(tmp_path):
    assert cli(tmp_path).exit_code == 0
    saved = json.loads((tmp_path / "out" / "sweep.json").read_text())
    for entry in saved["configs"].values():
        entry["max_load"] = entry["max_load"] * 2  # a baseline that served twice the load
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps(saved))
    gated = cli(tmp_path, "--overwrite", "--assert", "inflight.max_load > 2 * inflight_fused.max_load")
    assert gated.exit_code == 1 and "FAILED" in gated.output
    regressed = cli(tmp_path, "--overwrite", "--baseline", str(baseline))
    assert regressed.exit_code == 1 and "regression: inflight" in regressed.output


def test_a_gate_naming_an_unknown_configuration_fails_before_any_point_runs(tmp_path):
    done = cli(tmp_path, "--assert", "v1.max_load > 0")
    assert done.exit_code == 2
    assert "v1" in done.output and not (tmp_path / "out" / "points.jsonl").exists()


def test_resume_refuses_a_sweep_with_a_different_slo(tmp_path):
    assert cli(tmp_path).exit_code == 0
    again = cli(tmp_path, "--resume", "--slo", "e2el=9000")
    assert again.exit_code == 2 and "different slo" in again.output


# -- what the command prints and writes: names whole, early stops told apart, plots that name points ------


def test_sweep_table_at_80_columns_keeps_each_configuration_name_whole(tmp_path):
    done = CliRunner().invoke(
        app,
        ["sweep", *(f"--set={k}={v}" for k, v in base_overrides().items()), "--schemes", "inflight,inflight_fused",
         "--grid", "engine.max_batch_size=16,64", "--slo", SLO_FLAGS, "--workers", "1", "-q", "--no-plot",
         "-o", str(tmp_path / "out")],
        env={"COLUMNS": "80"},
    )  # fmt: skip
    assert done.exit_code == 0, done.output
    assert "…" not in done.output
    for name in ("inflight:bs16", "inflight:bs64", "inflight_fused:bs16", "inflight_fused:bs64"):
        assert f"│ {name} " in done.output


def test_a_point_stopped_early_is_reported_as_stopped_not_as_a_miss_of_figures_that_met_the_slo():
    from bm.cli.sweep import point_verdict
    from bm.sweep.runner import Point

    stopped = Point("inflight", 8.0, False, {"ttft": 1742.0}, {"stopped_early": True, "not_run": 12,
                                                                "stopped_on": "ttft"})  # fmt: skip
    assert point_verdict(stopped) == "[red]stopped early[/]: ttft sure to miss (12 not run)"
    missed = Point("inflight", 8.0, False, {"ttft": 2500.0}, {"stopped_early": False})
    assert point_verdict(missed) == "[red]miss[/] ttft=2500ms"


def test_sweep_csv_counts_requests_a_stopped_point_never_ran_as_not_run_not_failed(tmp_path):
    import csv

    assert cli(tmp_path, "--grid", "engine.max_batch_size=16,64").exit_code == 0
    rows = list(csv.DictReader((tmp_path / "out" / "sweep.csv").open()))
    stopped = [r for r in rows if r["stopped_early"] == "True"]
    assert stopped, "the SLO is tight enough that some point stops early"
    for row in stopped:
        assert row["failed"] == "0" and int(row["not_run"]) > 0 and row["feasible"] == "False"
        assert int(row["completed"]) + int(row["not_run"]) == int(row["num_requests"])
        assert row["stopped_on"] in ("ttft", "tpot", "e2el", "ttft,tpot", "ttft,e2el", "failed")


def test_pareto_plot_names_the_configuration_of_each_front_point():
    from bm.sweep.plots import _pareto
    from bm.sweep.runner import ConfigOutcome, Point

    def point(name: str, load: float, tpot: float, out: float, feasible: bool = True) -> Point:
        return Point(name, load, feasible, {}, {"mean_tpot_ms": tpot, "output_throughput": out})

    fast = ConfigOutcome("inflight_fused:bs64", {}, 8.0, [point("a", 4, 10, 100), point("a", 8, 20, 300)])
    slow = ConfigOutcome("inflight:bs16", {}, 4.0, [point("b", 4, 10, 100), point("b", 8, 25, 200, False)])
    figure = _pareto([fast, slow], "rate")
    axes = figure.axes[0]
    labels = sorted(text.get_text() for text in axes.texts)
    # the point both configurations reach at rate 4 names both; rate 8 only the one that made it
    assert labels == ["inflight_fused:bs64 @ rate 4\ninflight:bs16 @ rate 4", "inflight_fused:bs64 @ rate 8"]
    legend = [text.get_text() for text in axes.get_legend().get_texts()]
    assert {"inflight_fused:bs64", "inflight:bs16"} <= set(legend)
