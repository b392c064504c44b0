"""Issue 38: a long ``bm bench`` shows where it is. Its stats and records are written as the run goes (a
killed run leaves them), a finished run's files are as they always were, and a progress line with the
time left is printed where no progress bar can be drawn."""

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
from rich.console import Console
from typer.testing import CliRunner

import bm.cli.progress
from bm.bench import ReplayProgress, run_bench, write_results
from bm.bench.metrics import RECORD_COLUMNS
from bm.bench.simulated import load_sim_model
from bm.cli.bench_report import bench_progress, replay_eta, tick
from bm.cli.journal import FileJournal
from bm.cli.main import app
from bm.cli.progress import PlainProgress, eta_s, format_duration, progress_line
from bm.compare.runner import run_compare
from bm.compare.variants import plan_variants
from bm.config import load_config
from bm.runfiles.outlock import LOCK_NAME
from bm.workloads import Row, arrival_times, load_workload
from tests.conftest import make_config
from tests.hang import HANG_S
from tests.recorder import Recorder

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


# -- a killed run -------------------------------------------------------------------------------------


def test_a_killed_bm_bench_leaves_its_stats_lines_and_finished_records_so_far(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-m", "bm", "bench", "--model", "tiny-random", "-q", "-o", str(out),
            "--dataset-kind", "synthetic", "-n", "2000", "--input-len", "64", "--output-len", "64",
            "--ignore-eos", "--set", "model.device=cpu"]  # fmt: skip
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + HANG_S  # a hang's bound: the wait is for the lines bm bench writes
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


def test_the_stream_of_a_simulated_run_holds_exactly_its_stats_rows_and_one_record_per_request(tmp_path):
    config, model, workload = sim_setup(tmp_path)
    recorder = Recorder()
    result = run_bench(config, model, workload, journal=recorder)
    assert len(recorder.stats) == result.iterations.num_iterations == result.metrics["num_iterations"]
    counters = [r["Iteration Counter"] for r in recorder.stats]
    assert counters == sorted(set(counters))  # every row once, in iteration order
    assert [r["index"] for r in recorder.in_order()] == list(range(60))


def test_a_finished_bm_bench_writes_the_files_a_library_run_with_a_file_journal_writes(tmp_path):
    """The CLI's files are the library's: byte for byte what a FileJournal and write_results leave (a
    simulated run is a function of its inputs, so the two runs are equal), records in workload order."""
    model_config = tmp_path / "tiny.json"
    model_config.write_text(json.dumps(TINY))
    out = tmp_path / "cli"
    args = ["bench", "--executor", "sim", "--hardware", "a100-80gb", "--model-config", str(model_config),
            "--dataset-kind", "synthetic", "-n", "60", "--input-len", "64", "--output-len", "24",
            "--range-ratio", "0.5", "--rate", "50", "--set", "engine.max_batch_size=8", "-q", "-o", str(out)]  # fmt: skip
    assert runner.invoke(app, args).exit_code == 0
    config, model, workload = sim_setup(tmp_path)
    library = tmp_path / "library"
    with FileJournal(library, workload.requests) as journal:
        result = run_bench(config, model, workload, journal=journal)
    write_results(library, result)
    for name in ("requests.jsonl", "stats.jsonl"):
        assert (out / name).read_bytes() == (library / name).read_bytes(), name
    results = sorted(p.name for p in out.iterdir() if p.name != LOCK_NAME)  # the lock: who writes there
    assert results == ["requests.jsonl", "results.json", "stats.jsonl"]
    assert [r["index"] for r in map(json.loads, complete_lines(out / "requests.jsonl"))] == list(range(60))


def test_write_results_without_the_streamed_files_names_the_journal_to_pass(tmp_path):
    config, model, workload = sim_setup(tmp_path)
    result = run_bench(config, model, workload)  # no journal: the records went nowhere
    with pytest.raises(FileNotFoundError, match="journal=FileJournal"):
        write_results(tmp_path / "out", result)


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
    assert result.metrics["completed"] == sum(r["ok"] for r in recorder.records) == 6
    assert len(recorder.stats) == result.metrics["num_iterations"] > 0
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
        streamed = [json.loads(line) for line in complete_lines(tmp_path / "requests.jsonl")]
    assert [r["error"] for r in streamed] == ["line 2: the batch manager stopped", "line 1: prompt: empty"]
    written = [json.loads(line) for line in complete_lines(tmp_path / "requests.jsonl")]  # finished
    assert [r["error"] for r in written] == ["line 1: prompt: empty", "line 2: the batch manager stopped"]
    assert complete_lines(tmp_path / "stats.jsonl") == ['{"Iteration Counter": 1}']


def test_a_file_journal_left_by_an_exception_keeps_its_records_in_finishing_order(tmp_path):
    record = dict.fromkeys(RECORD_COLUMNS)
    with pytest.raises(KeyboardInterrupt), FileJournal(tmp_path) as journal:
        journal.add_requests([record | {"index": 1}, record | {"index": 0}])
        raise KeyboardInterrupt
    assert [json.loads(line)["index"] for line in complete_lines(tmp_path / "requests.jsonl")] == [1, 0]
    assert not (tmp_path / "stats.jsonl").exists()  # as streamed: no iteration came


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
        assert len(recorder.stats) == outcome.last.metrics["num_iterations"]
        assert sorted(r["index"] for r in recorder.records) == list(range(12))


# -- progress -----------------------------------------------------------------------------------------


def test_eta_is_the_work_left_at_the_rate_so_far():
    assert eta_s(250, 1000, 10.0) == pytest.approx(30.0)
    assert eta_s(1000, 1000, 10.0) == 0.0
    assert eta_s(1200, 1000, 10.0) == 0.0  # more than expected (a longer beam): never negative
    assert eta_s(0, 1000, 10.0) is None  # no rate yet
    assert eta_s(10, None, 10.0) is None  # no total
    assert eta_s(10, 1000, 0.0) is None


def test_the_bench_eta_counts_output_tokens_when_their_total_is_known_else_requests():
    known = ReplayProgress(num_requests=10, num_finished=5, num_output_tokens=100, elapsed_s=10.0,
                           num_expected_output_tokens=400)  # fmt: skip
    assert replay_eta(known) == pytest.approx(30.0)  # 300 tokens left at 10/s
    unknown = ReplayProgress(num_requests=10, num_finished=5, num_output_tokens=100, elapsed_s=10.0)
    assert replay_eta(unknown) == pytest.approx(10.0)  # 5 requests left at 0.5/s


def test_durations_read_as_a_clock():
    assert [format_duration(s) for s in (0, 0.2, 27, 59.5, 725, 3725)] == [
        "0:00", "0:01", "0:27", "1:00", "12:05", "1:02:05"
    ]  # fmt: skip
    assert format_duration(None) == "?"


def test_the_plain_progress_line_fits_80_columns():
    line = progress_line("bm bench", 312, 1024, 45210, 11.9, 27.2)
    assert line == "bm bench [0:12] 312/1,024 requests, 45,210 output tokens (3,799/s), ETA 0:28"
    assert len(progress_line("bm bench", 31200, 100000, 4521000, 1186, 3725)) <= 90
    assert progress_line("bm run", 4, 4, 40, 2.0, None, final=True).endswith("output tokens (20/s)")


def test_a_plain_line_comes_every_interval_and_once_at_the_end_without_an_eta():
    now = [0.0]
    console = Console(width=80, record=True, color_system=None)
    plain = PlainProgress(console, "bm run", interval_s=10.0, clock=lambda: now[0])
    for second in range(26):  # the figures move every second; a line every 10
        now[0] = float(second)
        plain.update(second, 100, 10 * second, float(second), eta_s(second, 100, second))
    plain.finish()
    assert console.export_text().splitlines() == [
        "bm run [0:10] 10/100 requests, 100 output tokens (10/s), ETA 1:30",
        "bm run [0:20] 20/100 requests, 200 output tokens (10/s), ETA 1:20",
        "bm run [0:25] 25/100 requests, 250 output tokens (10/s)",
    ]
    plain.finish()  # nothing moved since: no second final line
    assert len(console.export_text().splitlines()) == 0  # export_text cleared the record


def test_the_progress_bar_shows_the_time_left_and_output_tok_s_at_80_columns():
    console = Console(width=80, force_terminal=True, record=True, color_system=None)
    progress = bench_progress(console, True)
    task = progress.add_task("replaying", total=1024, tps="0", rps="0", eta="?")
    tick(progress, task, ReplayProgress(1024, 312, 45210, 11.86, 148000))
    console.print(progress.get_renderable())
    (line,) = console.export_text().splitlines()
    assert len(line) <= 80 and "312/1024" in line
    assert "ETA 0:27" in line and "3,812 output tok/s" in line and "26.31 req/s" in line


def sim_bench_args(tmp_path: Path, *extra: str) -> list[str]:
    model_config = tmp_path / "tiny.json"
    model_config.write_text(json.dumps(TINY))
    return ["bench", "--executor", "sim", "--hardware", "a100-80gb", "--model-config", str(model_config),
            "--dataset-kind", "synthetic", "-n", "300", "--input-len", "64", "--output-len", "32",
            "--rate", "50", "--ignore-eos", *extra]  # fmt: skip


PLAIN_LINE = r"bm bench \[\d+:\d\d\] [\d,]+/300 requests, [\d,]+ output tokens \([\d,]+/s\)"


def test_off_a_terminal_bm_bench_prints_a_plain_progress_line_with_the_time_left(tmp_path, monkeypatch):
    monkeypatch.setattr(bm.cli.progress, "PLAIN_INTERVAL_S", 0.0)
    result = runner.invoke(app, sim_bench_args(tmp_path, "-o", str(tmp_path / "out")))
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("bm bench [")]
    assert len(lines) >= 2, result.output
    assert all(re.fullmatch(PLAIN_LINE + r", ETA \d+:\d\d", line) for line in lines), lines
    assert "300/300 requests" in lines[-1]
    assert "replaying" not in result.output  # no progress bar drawn into the log


@pytest.mark.parametrize("flag", ["-q", "--json"])
def test_quiet_and_json_print_no_progress_line(tmp_path, monkeypatch, flag):
    monkeypatch.setattr(bm.cli.progress, "PLAIN_INTERVAL_S", 0.0)
    result = runner.invoke(app, sim_bench_args(tmp_path, flag, "-o", str(tmp_path / "out")))
    assert result.exit_code == 0, result.output
    assert "bm bench [" not in result.output and "bm bench [" not in result.stderr
