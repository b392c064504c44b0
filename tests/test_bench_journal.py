"""Issue 38: a long ``bm bench`` shows where it is. Its stats and records are written as the run goes (a
killed run leaves them), and a finished run's files are as they always were."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bm.bench import run_bench, write_results
from bm.bench.metrics import RECORD_COLUMNS
from bm.bench.results import request_line, stats_line
from bm.cli.journal import FileJournal
from bm.cli.main import app
from bm.compare.runner import run_compare
from bm.compare.variants import plan_variants
from bm.config import load_config
from bm.sim.run import load_sim_model
from bm.workloads import Row, arrival_times, load_workload
from tests.conftest import make_config

runner = CliRunner()
# The seed's per-iteration field names (DESIGN.md, "Stats and metrics").
SEED_STATS_FIELDS = (
    "Timestamp", "Iteration Counter", "Active Request Count", "Max Request Count", "Max KV cache blocks",
    "Free KV cache blocks", "Used KV cache blocks", "Scheduled Requests", "Context Requests",
    "Generation Requests", "Total Context Tokens", "MicroBatch ID",
)  # fmt: skip
TINY = {
    "model_type": "llama", "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "intermediate_size": 16, "vocab_size": 512, "max_position_embeddings": 4096,
}  # fmt: skip


def strict_json(line: str):
    """json.loads that refuses NaN and Infinity, which strict JSON readers (jq, JavaScript) reject."""

    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")

    return json.loads(line, parse_constant=refuse)


def complete_lines(path: Path) -> list[str]:
    """The newline-terminated lines of ``path`` (a kill may have cut only a last, unterminated one)."""
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    return text.split("\n")[:-1]


class Recorder:
    """A journal that keeps what it is given, in the order given."""

    def __init__(self) -> None:
        self.stats: list[dict] = []
        self.records: list[dict] = []

    def add_stats(self, rows):
        self.stats.extend(rows)

    def add_requests(self, records):
        self.records.extend(records)


# -- a killed run -------------------------------------------------------------------------------------


def test_a_killed_bm_bench_leaves_its_stats_lines_and_finished_records_so_far(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-m", "bm.cli.main", "bench", "--model", "tiny-random", "-q", "-o", str(out),
            "--dataset-kind", "synthetic", "-n", "2000", "--input-len", "64", "--output-len", "64",
            "--ignore-eos", "--set", "model.device=cpu"]  # fmt: skip
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not (complete_lines(out / "stats.jsonl") and complete_lines(out / "requests.jsonl")):
            if proc.poll() is not None:
                pytest.fail(f"bm bench ended before it wrote anything: {proc.communicate()}")
            if time.monotonic() > deadline:
                pytest.fail("no stats.jsonl and requests.jsonl lines appeared")
            time.sleep(0.05)
    finally:
        proc.kill()  # SIGKILL: no handler runs, nothing is written at the end
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "results.json").exists()  # killed mid-run, not after it

    stats = [strict_json(line) for line in complete_lines(out / "stats.jsonl")]
    assert stats and all(set(SEED_STATS_FIELDS) <= set(row) for row in stats)
    counters = [row["Iteration Counter"] for row in stats]
    assert counters == sorted(set(counters))  # increasing, none twice
    assert all(re.fullmatch(r"\d\d-\d\d-\d{4} \d\d:\d\d:\d\d", row["Timestamp"]) for row in stats)

    records = [strict_json(line) for line in complete_lines(out / "requests.jsonl")]
    assert records and len({r["index"] for r in records}) == len(records)  # each request once
    for r in records:
        assert list(r) == list(RECORD_COLUMNS)
        assert r["ok"] and r["finish_reason"] == "length" and r["error"] is None
        assert r["output_tokens"] == 64 == len(r["itl_ms"]) + 1 and r["input_tokens"] == 64
        assert 0 <= r["index"] < 2000 and r["ttft_ms"] <= r["e2el_ms"]


# -- a finished run -----------------------------------------------------------------------------------


def sim_setup(tmp_path: Path, **sets):
    model_config = tmp_path / "tiny.json"
    model_config.write_text(json.dumps(TINY))
    overrides = {
        "engine.executor": "sim", "sim.hardware": "a100-80gb", "model.config": str(model_config),
        "bench.dataset_kind": "synthetic", "bench.num_requests": 60, "bench.input_len": 64,
        "bench.output_len": 24, "bench.range_ratio": 0.5, "bench.request_rate": 50.0,
        "engine.max_batch_size": 8,
    } | sets  # fmt: skip
    config = load_config(None, overrides)
    model = load_sim_model(config)
    return config, model, load_workload(config.bench, vocab_size=model.vocab_size, encode=None)


def test_the_stream_of_a_simulated_run_holds_exactly_its_stats_rows_and_records(tmp_path):
    config, model, workload = sim_setup(tmp_path)
    recorder = Recorder()
    result = run_bench(config, model, workload, journal=recorder)
    assert recorder.stats == result.stats  # every row once, in iteration order
    streamed = sorted(recorder.records, key=lambda r: r["index"])
    final = result.records.to_dict("records")
    assert [request_line(r) for r in streamed] == [request_line(r) for r in final]


def test_a_finished_bm_bench_replaces_the_streamed_files_with_the_files_it_always_wrote(tmp_path):
    """The journal changes nothing in a finished run's files: byte for byte what write_results writes
    from the run's result (a simulated run is a function of its inputs, so the two runs are equal)."""
    model_config = tmp_path / "tiny.json"
    model_config.write_text(json.dumps(TINY))
    out = tmp_path / "cli"
    args = ["bench", "--executor", "sim", "--hardware", "a100-80gb", "--model-config", str(model_config),
            "--dataset-kind", "synthetic", "-n", "60", "--input-len", "64", "--output-len", "24",
            "--range-ratio", "0.5", "--rate", "50", "--set", "engine.max_batch_size=8", "-q", "-o", str(out)]  # fmt: skip
    assert runner.invoke(app, args).exit_code == 0
    config, model, workload = sim_setup(tmp_path)
    write_results(tmp_path / "library", run_bench(config, model, workload))
    for name in ("requests.jsonl", "stats.jsonl"):
        assert (out / name).read_bytes() == (tmp_path / "library" / name).read_bytes(), name
    assert sorted(p.name for p in out.iterdir()) == ["requests.jsonl", "results.json", "stats.jsonl"]
    assert [r["index"] for r in map(json.loads, complete_lines(out / "requests.jsonl"))] == list(range(60))


def test_a_real_run_streams_each_measured_request_once_warm_up_and_refused_rows_included_as_final(
    tmp_path, tiny_model
):
    rows = [{"input_ids": [3 + i, 5, 7, 9][: 1 + i % 4], "max_tokens": 2 + i % 3} for i in range(6)]
    rows.insert(3, {"prompt": "", "max_tokens": 2})  # refused at load: its record comes first
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = make_config(bench={"dataset": str(path), "warmup": 3, "ignore_eos": True})
    workload = load_workload(config.bench, vocab_size=tiny_model.vocab_size, encode=None)
    recorder = Recorder()
    result = run_bench(config, tiny_model, workload, arrival_times(workload, config.bench), journal=recorder)
    assert recorder.records[0]["index"] == 3 and not recorder.records[0]["ok"]
    assert sorted(r["index"] for r in recorder.records) == list(range(7))  # no warm-up request
    streamed = sorted(recorder.records, key=lambda r: r["index"])
    assert [request_line(r) for r in streamed] == [request_line(r) for r in result.records.to_dict("records")]
    assert [stats_line(r) for r in recorder.stats] == [stats_line(r) for r in result.stats]
    assert [r["Iteration Counter"] for r in recorder.stats] == sorted(
        r["Iteration Counter"] for r in recorder.stats
    )


def test_a_run_where_every_request_fails_in_the_engine_still_writes_an_empty_stats_file(tmp_path):
    dataset = tmp_path / "d.jsonl"
    dataset.write_text('{"input_ids": [99999], "max_tokens": 2}\n' * 2)
    out = tmp_path / "out"
    result = runner.invoke(app, ["bench", str(dataset), "-q", "-o", str(out), "--set", "model.device=cpu"])
    assert result.exit_code == 3, result.output
    assert (out / "stats.jsonl").read_text() == ""  # no iteration ran: nothing streamed, the file is made
    errors = [json.loads(line)["error"] for line in complete_lines(out / "requests.jsonl")]
    assert [e.split(":")[0] for e in errors] == ["line 1", "line 2"]


def test_the_file_journal_names_an_engine_error_by_its_line_as_the_final_records_do(tmp_path):
    rows = [Row(where="line 1"), Row(where="line 2")]
    record = dict.fromkeys(RECORD_COLUMNS) | {"index": 1, "error": "the batch manager stopped"}
    with FileJournal(tmp_path, rows) as journal:
        journal.add_requests([record, record | {"index": 0, "error": "line 1: prompt: empty"}])
        journal.add_stats([{"Iteration Counter": 1}])
    written = [json.loads(line) for line in complete_lines(tmp_path / "requests.jsonl")]
    assert [r["error"] for r in written] == ["line 2: the batch manager stopped", "line 1: prompt: empty"]
    assert complete_lines(tmp_path / "stats.jsonl") == ['{"Iteration Counter": 1}']


def test_a_journal_that_is_given_nothing_creates_no_file(tmp_path):
    with FileJournal(tmp_path / "out"):
        pass
    assert not (tmp_path / "out").exists()


def test_compare_hands_each_run_of_a_bm_variant_a_fresh_journal(tmp_path):
    config, model, workload = sim_setup(tmp_path, **{"bench.num_requests": 12})
    variants = plan_variants("v1,inflight_fused", "guaranteed_no_evict", "")
    given: list[tuple[str, Recorder]] = []

    class Entered:
        def __init__(self, variant):
            self.recorder = Recorder()
            given.append((variant.name, self.recorder))

        def __enter__(self):
            return self.recorder

        def __exit__(self, *exc):
            return None

    result = run_compare(config, model, workload, arrival_times(workload, config.bench), variants,
                         repeat=2, journal=Entered)  # fmt: skip
    assert [name for name, _ in given] == ["v1", "inflight_fused"] * 2
    for outcome in result.variants:  # the last repeat's journal holds what the variant's files hold
        recorder = [r for name, r in given if name == outcome.variant.name][-1]
        assert recorder.stats == outcome.last.stats
        assert sorted(r["index"] for r in recorder.records) == list(range(12))
