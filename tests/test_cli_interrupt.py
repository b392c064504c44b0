"""Interrupt and resume: a signal ends queued requests too (every line keeps its record), a killed run
resumes to what an uninterrupted run writes, and a previous run's directory is never silently replaced."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from bm.cli.main import app
from tests.conftest import REPO
from tests.hang import HANG_S

runner = CliRunner()
MAX_BATCH = 4


def write_prompts(path, n, max_tokens):
    path.write_text(
        "".join(json.dumps({"id": f"r{i}", "prompt": f"request number {i} " * (1 + i % 3), "max_tokens": max_tokens}) + "\n" for i in range(n))
    )  # fmt: skip
    return path


def bm_run_process(prompts, out, *extra):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-m", "bm", "run", str(prompts), "-o", str(out), "-q", "--ignore-eos"]
    args += ["--set", "model.device=cpu", "--set", f"engine.max_batch_size={MAX_BATCH}", *extra]
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_records(proc, outputs, count, timeout=HANG_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if outputs.exists() and len(outputs.read_text().splitlines()) >= count:
            return
        if proc.poll() is not None:
            pytest.fail(f"bm run ended before {count} records: {proc.communicate()}")
        time.sleep(0.02)
    proc.kill()
    pytest.fail("no records appeared")


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_mid_run_cancels_queued_requests_and_keeps_every_record(tmp_path, sig):
    n = 48
    prompts = write_prompts(tmp_path / "p.jsonl", n, max_tokens=48)
    out = tmp_path / "out"
    proc = bm_run_process(prompts, out)
    wait_for_records(proc, out / "outputs.jsonl", MAX_BATCH)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert f"-o {out} --resume" in " ".join(stdout.split())  # the way to finish the run is printed
    records = read_jsonl(out / "outputs.jsonl")
    assert sorted(r["index"] for r in records) == list(range(n))  # every line has its record
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] and summary["num_requests"] == n
    # Only the requests of the iteration the signal landed in may still finish by length; the rest
    # (active ones and the queued ones that never started) are cancelled.
    by_length = [r for r in records if r["finish_reason"] == "length"]
    assert len(by_length) <= summary["records_before_interrupt"] + MAX_BATCH
    cancelled = [r for r in records if r["finish_reason"] == "cancelled"]
    assert len(cancelled) == n - len(by_length) and len(cancelled) > n // 2
    # cancelled requests count as cancelled, not as succeeded
    assert summary["num_cancelled"] == len(cancelled) and summary["num_ok"] == len(by_length)
    assert all(r["error"] is None for r in records)
    ran = [r for r in records if r["num_output_tokens"]]  # requests cancelled before starting ran nothing
    assert summary["num_prompt_tokens"] == sum(r["num_prompt_tokens"] for r in ran)


def test_a_signal_during_start_up_ends_the_run_there_without_a_traceback(tmp_path):
    """The checks are done (``-o`` exists) and torch or the model is loading: the signal stops that where
    it is. Either nothing had started (no records), or the model was loading and every line ends
    ``cancelled`` with the resume command printed; never a traceback, never a load run to its end."""
    n = 48
    prompts = write_prompts(tmp_path / "p.jsonl", n, max_tokens=48)
    out = tmp_path / "out"
    proc = bm_run_process(prompts, out)
    while not out.exists():  # made by the checks that run before torch loads (which takes seconds)
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    if (out / "outputs.jsonl").exists():
        records = read_jsonl(out / "outputs.jsonl")
        assert sorted(r["index"] for r in records) == list(range(n))
        assert {r["finish_reason"] for r in records} == {"cancelled"}
        assert f"-o {out} --resume" in " ".join(stdout.split())
    else:
        assert "interrupted during start-up; nothing ran" in stderr


def test_sigkill_then_resume_gives_the_outputs_of_an_uninterrupted_run(tmp_path):
    n = 16
    prompts = write_prompts(tmp_path / "p.jsonl", n, max_tokens=24)
    reference = tmp_path / "reference"
    done = bm_run_process(prompts, reference)
    assert done.wait(timeout=HANG_S) == 0, done.communicate()
    expected = {r["index"]: r["output_ids"] for r in read_jsonl(reference / "outputs.jsonl")}

    out = tmp_path / "out"
    proc = bm_run_process(prompts, out)
    wait_for_records(proc, out / "outputs.jsonl", MAX_BATCH)
    proc.kill()  # SIGKILL: no handler, no summary, maybe a torn last line
    proc.wait()
    with (out / "outputs.jsonl").open("a") as f:
        f.write('{"index": 3, "output_ids": [1, 2')  # what a kill in the middle of a write leaves
    before = len(read_jsonl_lenient(out / "outputs.jsonl"))
    assert before < n

    resumed = bm_run_process(prompts, out, "--resume")
    _stdout, stderr = resumed.communicate(timeout=HANG_S)
    assert resumed.returncode == 0, stderr
    records = read_jsonl(out / "outputs.jsonl")
    assert sorted(r["index"] for r in records) == list(range(n))  # exactly one record per line
    assert {r["index"]: r["output_ids"] for r in records} == expected
    summary = json.loads((out / "summary.json").read_text())
    # kept records are reported apart: this run's counts and tok/s are its own work only
    assert summary["num_resumed"] >= MAX_BATCH and summary["num_resumed"] + summary["num_ok"] == n
    # stats.jsonl holds both runs' rows (its counter restarts at 1), each marked with its run
    stats = read_jsonl_lenient(out / "stats.jsonl")
    runs = [row["Run Id"] for row in stats]
    assert len(set(runs)) == 2 and runs[-1] == summary["run_id"]
    assert next(row["Iteration Counter"] for row in stats if row["Run Id"] == summary["run_id"]) == 1


def read_jsonl_lenient(path):
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(line))
    return out


def test_a_non_empty_run_directory_needs_resume_or_overwrite(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 2, max_tokens=2)
    out = tmp_path / "out"
    args = ["run", str(prompts), "-o", str(out), "-q", "--set", "model.device=cpu"]
    assert runner.invoke(app, args).exit_code == 0
    first = (out / "outputs.jsonl").read_text()
    refused = runner.invoke(app, args)
    assert refused.exit_code == 2 and "--overwrite" in refused.output
    assert (out / "outputs.jsonl").read_text() == first  # untouched
    both = runner.invoke(app, [*args, "--resume", "--overwrite"])
    assert both.exit_code == 2 and "exclusive" in both.output

    one = write_prompts(tmp_path / "one.jsonl", 1, max_tokens=2)
    other = runner.invoke(app, ["run", str(one), "-o", str(out), "--resume", "-q"])
    assert other.exit_code == 2 and "different prompts file" in " ".join(other.output.split())
    replaced = runner.invoke(app, ["run", str(one), "-o", str(out), "--overwrite", "-q", "--set", "model.device=cpu"])  # fmt: skip
    assert replaced.exit_code == 0 and len(read_jsonl(out / "outputs.jsonl")) == 1


def test_bm_bench_refuses_a_non_empty_results_directory_without_overwrite(tmp_path):
    out = tmp_path / "bench"
    out.mkdir()
    (out / "results.json").write_text("{}")
    args = ["bench", "--dataset-kind", "synthetic", "--num-requests", "2", "--input-len", "4"]
    args += ["--output-len", "2", "-o", str(out), "-q", "--set", "model.device=cpu"]
    refused = runner.invoke(app, args)
    assert refused.exit_code == 2 and "--overwrite" in refused.output
    assert (out / "results.json").read_text() == "{}"
    ran = runner.invoke(app, [*args, "--overwrite"])
    assert ran.exit_code == 0, ran.output
    assert json.loads((out / "results.json").read_text())["completed"] == 2


def test_the_printed_resume_command_resumes_the_run(tmp_path):
    """Issue 41: the command printed after Ctrl-C dropped --ignore-eos and -s, so running it exactly was
    refused ("the run options changed"). It now repeats every option given; run as printed, it finishes."""
    import shlex

    n = 24
    prompts = write_prompts(tmp_path / "p.jsonl", n, max_tokens=40)
    out = tmp_path / "out"
    proc = bm_run_process(prompts, out, "--max-tokens", "7", "--set", "engine.max_seq_len=512", "--seed", "5")
    wait_for_records(proc, out / "outputs.jsonl", MAX_BATCH)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 130, stderr
    printed = " ".join(stdout.split()).split("run them with ", 1)[1]
    words = shlex.split(printed)
    assert words[:2] == ["bm", "run"] and words[-1] == "--resume"
    for option in ("--ignore-eos", "--max-tokens", "engine.max_seq_len=512", "model.device=cpu", "--seed"):
        assert option in words, printed
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    resumed = subprocess.run(
        [sys.executable, "-m", "bm", *words[1:]],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    records = read_jsonl(out / "outputs.jsonl")
    assert sorted(r["index"] for r in records) == list(range(n))
    assert all(r["finish_reason"] == "length" for r in records)
