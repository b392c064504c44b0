"""The simulator as a CI gate: ``bm compare --executor sim`` gives the same bits every run, so its timings
are gated exactly, and a planted scheduler regression (one more iteration per request) fails it."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from bm.cli.main import app
from tests.benchmark_scripts import load_benchmark
from tests.conftest import REPO

runner = CliRunner()
SIM = [
    "compare", "--executor", "sim", "--model-config", str(REPO / "configs" / "models" / "bench-llama-15m.json"),
    "--dataset-kind", "synthetic", "--input-len", "128", "--output-len", "32", "--num-requests", "24",
    "--ignore-eos", "--schemes", "v1,inflight_fused", "--quiet",
]  # fmt: skip


def planted_extra_iteration():
    return load_benchmark("planted_iteration").planted_extra_iteration()


def simulate(out, *extra):
    result = runner.invoke(app, [*SIM, "-o", str(out), *map(str, extra)])
    return result, (
        json.loads((out / "compare.json").read_text()) if (out / "compare.json").exists() else None
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("sim") / "base"
    result, doc = simulate(out)
    assert result.exit_code == 0, result.output
    return out / "compare.json", doc


def test_two_simulated_comparisons_give_identical_timings_and_the_second_passes_exactly(saved, tmp_path):
    path, first = saved
    result, second = simulate(tmp_path / "again", "--baseline", path)
    assert result.exit_code == 0, result.output
    for name in ("v1", "inflight_fused"):
        assert second["variants"][name]["timings"] == first["variants"][name]["timings"]
        assert second["variants"][name]["timings"]["output_throughput"]["repeats"] == 1  # nothing to average
    gate = second["baseline"]
    assert gate["timings_from"] == "simulated" and gate["regressions"] == []
    assert all(c["exact"] and c["margin"] == 0.0 for c in gate["timing_checks"])
    assert "must match the baseline's exactly" in " ".join(result.output.split())


def test_a_planted_extra_iteration_per_request_fails_the_simulator_gate_on_its_timings(saved, tmp_path):
    path, _ = saved
    with planted_extra_iteration():
        result, doc = simulate(tmp_path / "planted", "--baseline", path)
    assert result.exit_code == 1, result.output
    found = {(r["variant"], r["metric"], r["kind"]) for r in doc["baseline"]["regressions"]}
    for name in ("v1", "inflight_fused"):
        assert (name, "median_ttft_ms", "timing") in found and (name, "output_throughput", "timing") in found
        assert (name, "num_iterations", "counter") in found
    flat = " ".join(result.output.split())
    assert "regression: inflight_fused.median_ttft_ms: simulated timing changed" in flat


def test_the_simulator_gate_needs_no_baseline_command(saved, tmp_path):
    path, _ = saved
    result, _ = simulate(tmp_path / "cmd", "--baseline", path, "--baseline-cmd", "bm")
    assert result.exit_code == 2
    assert "--baseline-cmd: not needed under --executor sim" in " ".join(result.output.split())
    assert not (tmp_path / "cmd").exists()
