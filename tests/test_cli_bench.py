"""`bm bench` end to end on the tiny model, and run_bench as a library for comparing variants."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from bm.bench import run_bench, write_results
from bm.cli.journal import FileJournal
from bm.cli.main import app
from bm.workloads import arrival_times, load_workload
from tests.conftest import make_config

runner = CliRunner()


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def bench(*args):
    return runner.invoke(app, ["bench", *map(str, args), "--quiet", "--set", "model.device=cpu"])


@pytest.fixture
def trace(tmp_path):
    rows = [
        {
            "id": f"r{i}",
            "input_ids": [3 + i, 5, 7, 9][: 1 + i % 4],
            "max_tokens": 2 + i % 3,
            "arrival_time": 0.02 * i,
        }
        for i in range(6)
    ]
    rows.insert(3, {"id": "bad", "prompt": "", "max_tokens": 2, "arrival_time": 0.05})
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_bench_replays_a_timed_trace_with_an_slo_and_writes_all_three_files(tmp_path, trace):
    config = tmp_path / "bench.yaml"
    config.write_text("kv_cache:\n  max_tokens: 2048\nbench:\n  warmup: 2\n  time_scale: 3.0\n")
    out = tmp_path / "out"
    result = bench(
        trace, "-c", config, "--trace-timestamps", "--time-scale", "0.5", "--ignore-eos",
        "--slo", "ttft=1e9,tpot=1e9", "--slo", "e2el=1e9", "--policy", "max_utilization", "-o", out,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["bench"]["time_scale"] == 0.5  # the flag overrides the file
    assert results["config"]["bench"]["warmup"] == 2
    assert results["scheduler_policy"] == "max_utilization"
    assert results["arrivals"] == {"process": "trace", "time_scale": 0.5, "max_concurrency": None}
    assert results["slo_ms"] == {"ttft": 1e9, "tpot": 1e9, "e2el": 1e9}
    assert set(results["runtime"]) == {
        "torch",
        "device",
        "weights",
        "torch_threads",
        "decode_attention",
        "cpu_isa",
    }
    assert results["runtime"]["weights"] == "none"  # model.quantization auto, resolved for a full-width model
    assert (results["num_requests"], results["completed"], results["failed"]) == (7, 6, 1)
    assert results["total_output_tokens"] == sum(2 + i % 3 for i in range(6))
    assert results["request_goodput"] == results["request_throughput"] > 0
    assert results["bm_version"] and results["model"] == "embedded tiny-llama" and results["seed"] == 0
    for key in ("mean_ttft_ms", "p99_tpot_ms", "median_itl_ms", "std_e2el_ms", "p90_queue_time_ms"):
        assert results[key] is not None and results[key] >= 0

    records = read_jsonl(out / "requests.jsonl")  # warm-up requests are not among them
    assert [r["index"] for r in records] == list(range(7))
    bad = records[3]
    assert not bad["ok"] and bad["id"] == "bad" and bad["error"] == "line 4: prompt: the prompt is empty"
    for r in records[:3] + records[4:]:
        assert r["ok"] and r["output_tokens"] == len(r["itl_ms"]) + 1
        assert r["send_s"] >= r["arrival_s"] and r["arrival_s"] == pytest.approx(0.01 * int(r["id"][1:]))
    stats = read_jsonl(out / "stats.jsonl")
    assert len(stats) == results["num_iterations"] > 0
    assert "Successful requests" in result.output and "TTFT" in result.output


def test_bench_plot_writes_the_same_pngs_as_report(tmp_path, trace):
    out = tmp_path / "out"
    result = bench(trace, "--ignore-eos", "-o", out, "--plot", "--set", "kv_cache.max_tokens=2048")
    assert result.exit_code == 0, result.output
    pngs = sorted(p.name for p in (out / "plots").glob("*.png"))
    assert pngs == sorted(
        [
            "latency_cdf.png",
            "throughput.png",
            "batch_composition.png",
            "kv_utilization.png",
            "paused_requests.png",
        ]
    )
    for name in pngs:
        assert (out / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_tight_slo_counts_no_good_request(tmp_path, trace):
    result = bench(trace, "--slo", "ttft=0.000001", "-o", tmp_path / "out", "--json")
    assert result.exit_code == 0, result.output
    results = json.loads(result.stdout)  # --json: stdout holds only the results document
    assert results["completed"] == 6 and results["request_goodput"] == 0.0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--rate", "2", "--trace-timestamps"],
            "bench.trace_timestamps and bench.request_rate are exclusive",
        ),
        (["--slo", "latency=3"], "--slo 'latency=3'"),
        (["--dataset-kind", "csvish"], "bench.dataset_kind"),
        (["--rate", "-1"], "bench.request_rate"),
        (["--time-scale", "2"], "bench.time_scale"),
    ],
)
def test_bad_options_exit_2_naming_the_key(trace, args, message):
    result = bench(trace, *args)
    assert result.exit_code == 2 and message in result.output, result.output


def test_bad_dataset_exits_2_naming_the_row(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:49,3,3\n2023-11-16 18:15:47,3,3\n"
    )
    result = bench(path, "--trace-timestamps", "-o", tmp_path / "out")
    assert result.exit_code == 2 and "line 3: timestamp goes backwards" in result.output, result.output


def test_run_bench_compares_schemes_on_one_workload_in_one_process(tmp_path, tiny_model):
    bench_section = {
        "dataset_kind": "synthetic",
        "num_requests": 6,
        "input_len": 6,
        "output_len": 4,
        "range_ratio": 0.5,
        "request_rate": 500.0,
        "ignore_eos": True,
    }
    config = make_config(bench=bench_section)
    workload = load_workload(config.bench, vocab_size=tiny_model.vocab_size, encode=None)
    times = arrival_times(workload, config.bench)
    results, records = {}, {}
    for scheme in ("v1", "inflight_fused"):
        variant = make_config(engine={"batching_scheme": scheme}, bench=bench_section)
        with FileJournal(tmp_path / scheme) as journal:
            results[scheme] = run_bench(variant, tiny_model, workload, times, journal=journal)
        records[scheme] = read_jsonl(tmp_path / scheme / "requests.jsonl")
    v1, fused = results["v1"], results["inflight_fused"]
    tokens = [r["output_tokens"] for r in records["v1"]]
    assert tokens == [r["output_tokens"] for r in records["inflight_fused"]]
    assert tokens == [r.max_tokens for r in workload.requests]
    assert [r["arrival_s"] for r in records["v1"]] == pytest.approx(times)
    assert v1.metrics.keys() == fused.metrics.keys()
    assert fused.metrics["total_empty_generation_slots"] == 0
    assert fused.metrics["total_computed_tokens"] == sum(
        r.input_len + r.max_tokens - 1 for r in workload.requests
    )
    document = write_results(tmp_path / "v1", v1)
    assert document["batching_scheme"] == "v1" and document["completed"] == 6
    assert len(read_jsonl(tmp_path / "v1" / "requests.jsonl")) == 6


def test_bench_with_ngram_speculation_reports_the_mean_acceptance_length(tmp_path):
    rows = [{"input_ids": [5, 6, 7, 8] * 6 + [5, 6], "max_tokens": 12} for _ in range(3)]
    path = tmp_path / "copy.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    spec = "engine.speculative={method: ngram, num_draft_tokens: 3, max_ngram: 2}"
    result = bench(path, "--ignore-eos", "--set", "kv_cache.max_tokens=2048", "--set", spec, "-o", out)
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())
    assert results["total_draft_tokens"] > 0
    assert results["mean_acceptance_length"] >= 1.0
    assert 0.0 <= results["draft_acceptance_rate"] <= 1.0
    assert "Mean acceptance length" in result.output


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_an_interrupted_bench_says_so_and_counts_cancelled_requests_apart_from_failed(tmp_path, sig):
    """Issue 41: Ctrl-C exited 130 but showed a normal table with 'Failed requests 185'. Issue 53: SIGTERM
    killed bm bench outright (exit 143, no results.json); both signals now end it the same way."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import REPO
    from tests.hang import HANG_S

    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    args = [
        sys.executable,
        "-m",
        "bm",
        "bench",
        "--dataset-kind",
        "synthetic",
        "--num-requests",
        "120",
    ]
    args += ["--input-len", "8", "--output-len", "48", "-o", str(out), "-q", "--set", "model.device=cpu"]
    args += ["--set", "engine.max_batch_size=2", "--set", "bench.warmup=0"]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    journal = out / "requests.jsonl"
    while not (journal.exists() and len(journal.read_text().splitlines()) >= 2):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(getattr(signal, sig))
    stdout, stderr = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 130, stderr
    screen = " ".join(stdout.split())
    assert "interrupted" in screen and "Cancelled requests" in screen
    results = json.loads((out / "results.json").read_text())
    assert results["interrupted"] and results["failed"] == 0
    assert (
        results["cancelled"] > 0
        and results["completed"] + results["cancelled"] == results["num_requests"] == 120
    )
    records = read_jsonl(journal)
    assert sum(r["finish_reason"] == "cancelled" for r in records) == results["cancelled"]


def batch_line(custom_id, url, body):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}) + "\n"


def test_bench_recognizes_an_openai_batch_file(tmp_path):
    """Issue 41: an OpenAI batch file was taken for a Hugging Face table (with a --prompt-column hint,
    which cannot reach a prompt nested in body). It is read by the batch reader bm run uses."""
    from bm.workloads import detect_kind

    path = tmp_path / "batch.jsonl"
    path.write_text(
        "".join(
            batch_line(f"c{i}", "/v1/completions", {"prompt": f"hello {i}", "max_tokens": 3})
            for i in range(3)
        )
    )
    assert detect_kind(path) == "openai-batch"
    out = tmp_path / "out"
    result = bench(path, "-o", out)
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())
    assert results["dataset"]["kind"] == "openai-batch"
    assert results["completed"] == 3 and results["total_output_tokens"] == 9
    assert sorted(r["id"] for r in read_jsonl(out / "requests.jsonl")) == ["c0", "c1", "c2"]


def test_bench_routes_body_model_as_bm_run_does_warns_once_per_unknown_field_and_refuses_what_it_cannot_time(
    tmp_path,
):
    """Served names answer, an unserved name is refused as bm run refuses it, an adapter line is refused
    naming bm run (bench applies no adapter), a prompt list is refused naming the line, the field and
    why, and an unknown body field is said once for the run, not silently dropped."""
    adapter = tmp_path / "sql"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    config = tmp_path / "bench.yaml"
    config.write_text(
        f"model:\n  served_model_name: [tiny, gpt-4o-mini]\n  lora_modules: {{sql: {adapter}}}\n"
    )
    url = "/v1/completions"
    path = tmp_path / "batch.jsonl"
    path.write_text(
        batch_line("plain", url, {"prompt": "hi", "max_tokens": 3})
        + batch_line(
            "named", url, {"prompt": "hi", "max_tokens": 3, "model": "gpt-4o-mini", "verbosity": "low"}
        )
        + batch_line("again", url, {"prompt": "yo", "max_tokens": 3, "verbosity": "high"})
        + batch_line("list", url, {"prompt": ["a", "b"], "max_tokens": 3})
        + batch_line("adapter", url, {"prompt": "hi", "max_tokens": 3, "model": "sql"})
        + batch_line("unknown", url, {"prompt": "hi", "max_tokens": 3, "model": "llama"})
    )
    out = tmp_path / "out"
    result = bench(path, "-c", config, "-o", out)
    said = " ".join(result.stderr.split())
    assert said.count("body.verbosity") == 1 and "body.verbosity (first on line 2)" in said
    errors = {r["id"]: r.get("error") for r in read_jsonl(out / "requests.jsonl")}
    assert [k for k, e in errors.items() if e is None] == ["plain", "named", "again"]
    assert errors["list"].startswith("line 4: body.prompt: a list of 2 prompts; bm bench replays one request")
    assert "give each prompt its own line (bm run answers a prompt list)" in errors["list"]
    assert errors["adapter"].startswith("line 5: body.model: 'sql' is a LoRA adapter")
    assert "run this file with bm run" in errors["adapter"]
    assert errors["unknown"].startswith("line 6: body.model: 'llama' is not served by this run")
    assert "model.served_model_name" in errors["unknown"]


def test_bench_refuses_a_bm_line_naming_a_lora_dir_rather_than_time_the_base_model(tmp_path):
    """bm run applies a line's lora_dir; a replay would run the base model and report its timings as
    the adapter's, so the line fails naming the field and bm run, and the other lines run."""
    path = tmp_path / "p.jsonl"
    path.write_text(
        json.dumps({"id": "base", "input_ids": [5, 6, 7], "max_tokens": 2})
        + "\n"
        + json.dumps({"id": "tuned", "input_ids": [5, 6, 7], "max_tokens": 2, "lora_dir": "adapter"})
        + "\n"
    )
    out = tmp_path / "out"
    bench(path, "-o", out)
    errors = {r["id"]: r.get("error") for r in read_jsonl(out / "requests.jsonl")}
    assert errors["base"] is None
    assert errors["tuned"].startswith("line 2: lora_dir: bm bench replays on the base model")
    assert errors["tuned"].endswith("run this file with bm run")


def test_bench_on_a_chat_batch_file_for_a_model_without_a_chat_template_names_the_flag(tmp_path):
    """Chat lines replay through the chat template (tests/test_bench_defaults.py); the embedded model's
    byte tokenizer has none, so the file is refused naming --chat-template, never read as a table."""
    path = tmp_path / "chat.jsonl"
    path.write_text(
        batch_line("a", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    )
    result = bench(path, "-o", tmp_path / "out")
    assert result.exit_code == 2
    error = " ".join(result.stderr.split())
    assert "line 1: messages" in error and "--chat-template" in error and "prompt-column" not in error
