"""`bm run` end to end on the embedded tiny model: files in, one record per line out."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from bm.cli.main import app
from tests.conftest import REPO

runner = CliRunner()


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def invoke(*args):
    result = runner.invoke(app, ["run", *map(str, args), "--quiet", "--set", "model.device=cpu"])
    return result


def test_run_on_the_shipped_sample_writes_one_record_per_line(tmp_path):
    sample = REPO / "datasets" / "prompts.jsonl"
    result = invoke(sample, "-o", tmp_path)
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in sample.read_text().splitlines() if line.strip()]
    records = read_jsonl(tmp_path / "outputs.jsonl")
    assert sorted(r["index"] for r in records) == list(range(len(lines)))
    assert {r["id"] for r in records} == {line["id"] for line in lines}
    for r in records:
        assert r["error"] is None and r["finish_reason"] in ("length", "stop")
        assert r["num_output_tokens"] == len(r["output_ids"]) > 0
        assert isinstance(r["text"], str)
    stats = read_jsonl(tmp_path / "stats.jsonl")
    assert stats and all("Iteration Counter" in s for s in stats)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (
        summary["num_ok"] == len(lines) and summary["config"]["engine"]["max_batch_size"] == 128
    )  # resolved for the CPU
    # what a reader needs to compare figures across machines
    assert summary["runtime"]["decode_attention"] in ("native", "torch")
    assert summary["runtime"]["device"] == "cpu" and summary["runtime"]["torch_threads"] >= 1
    assert summary["runtime"]["weights"] == "none"  # model.quantization auto, as the model is stored
    # start-up on its own, before the run's clock: the model's load and the engine's build
    assert summary["startup"]["total_s"] >= summary["startup"]["load_model_s"] > 0
    assert "start-up" in result.output
    assert "output tok/s" in result.output


def test_each_bad_line_becomes_exactly_one_error_record_and_the_rest_complete(tmp_path):
    prompts = tmp_path / "p.jsonl"
    lines = [
        '{"prompt": "good one", "max_tokens": 5}',
        '{"prompt": "broken", ',
        '{"max_tokens": 5}',
        '{"prompt": "", "max_tokens": 5}',
        json.dumps({"input_ids": [5] * 3000, "max_tokens": 5}),
        '{"prompt": "hi", "colour": "blue"}',
        '{"prompt": "hi", "max_tokens": -3}',
        '{"input_ids": [5, 6, 7], "request_output_len": 4}',
        "",
        '{"prompt": "hi", "temperature": -1}',
    ]
    prompts.write_text("\n".join(lines) + "\n")
    result = invoke(prompts, "-o", tmp_path / "out", "--set", "engine.max_num_tokens=4096")
    assert result.exit_code == 0, result.output
    records = {r["index"]: r for r in read_jsonl(tmp_path / "out" / "outputs.jsonl")}
    assert len(records) == 9  # the blank line is not a request
    ok = {i for i, r in records.items() if r["error"] is None}
    assert ok == {0, 7}
    errors = {i: r["error"] for i, r in records.items() if r["error"]}
    assert "malformed JSON" in errors[1] and errors[1].startswith("line 2:")
    assert "missing prompt" in errors[2]
    assert "prompt is empty" in errors[3]
    assert "longer than the model's maximum" in errors[4]
    assert "unknown field 'colour'" in errors[5]
    assert "max_tokens: must be at least 1, got -3" in errors[6]
    # the index is the line's 0-based number: the blank line 9 shifts nothing after it
    assert "temperature" in errors[9] and errors[9].startswith("line 10:")
    assert all(e.startswith(f"line {i + 1}: ") for i, e in errors.items())
    assert all(r["finish_reason"] == "error" for i, r in records.items() if i not in ok)
    assert all(r["text"] == "" for i, r in records.items() if i not in ok)  # every record has every key
    assert "7 request(s) failed" in result.output


def test_duplicate_ids_are_reported(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        '{"id": "a", "prompt": "x", "max_tokens": 2}\n{"id": "a", "prompt": "y", "max_tokens": 2}\n'
    )
    result = invoke(prompts, "-o", tmp_path / "out")
    assert result.exit_code == 0
    records = sorted(read_jsonl(tmp_path / "out" / "outputs.jsonl"), key=lambda r: r["index"])
    assert records[0]["error"] is None
    assert "duplicate id 'a' (also on line 1)" in records[1]["error"]


def test_config_problems_exit_with_code_2_and_one_clear_line(tmp_path):
    sample = REPO / "datasets" / "prompts.jsonl"
    result = invoke(sample, "-o", tmp_path, "--set", "engine.max_batch=3")
    assert result.exit_code == 2
    assert "engine.max_batch: unknown key" in result.output
    result = invoke(tmp_path / "missing.jsonl")
    assert result.exit_code == 2 and "does not exist" in result.output
    result = invoke(sample, "--model", str(tmp_path))
    assert result.exit_code == 2 and "not a checkpoint directory" in result.output


def test_run_help_documents_the_config_keys():
    result = runner.invoke(app, ["run", "--help"])
    assert result.exit_code == 0
    for key in ("tokens_per_block", "free_memory_fraction", "max_num_tokens", "batching_scheme"):
        assert key in result.output


def test_run_takes_drafts_and_prompt_lookup_without_changing_greedy_outputs(tmp_path):
    lines = [
        {"input_ids": [5, 6, 7, 8] * 4, "max_tokens": 10},
        {"input_ids": [9, 10, 11], "max_tokens": 10, "draft_input_ids": [12, 13, 14]},
    ]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    plain = invoke(prompts, "-o", tmp_path / "plain", "--set", "kv_cache.max_tokens=1024")
    spec = "engine.speculative={method: ngram, num_draft_tokens: 3, max_ngram: 2}"
    drafted = invoke(prompts, "-o", tmp_path / "spec", "--set", "kv_cache.max_tokens=1024", "--set", spec)
    assert plain.exit_code == 0 and drafted.exit_code == 0, plain.output + drafted.output
    a = read_jsonl(tmp_path / "plain" / "outputs.jsonl")
    b = read_jsonl(tmp_path / "spec" / "outputs.jsonl")
    assert all(r["error"] is None for r in a + b)
    assert sorted((r["index"], r["output_ids"]) for r in a) == sorted(
        (r["index"], r["output_ids"]) for r in b
    )
    assert sum(s["Draft Tokens"] for s in read_jsonl(tmp_path / "spec" / "stats.jsonl")) > 0


def test_version_prints_bm_torch_and_transformers_versions_and_exits_0():
    import torch
    import transformers

    import bm

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"bm {bm.__version__} ")
    assert f"torch {torch.__version__}" in result.output
    assert f"transformers {transformers.__version__}" in result.output


def test_off_a_terminal_run_prints_a_plain_progress_line_with_the_time_left(tmp_path, monkeypatch):
    import re

    import bm.cli.progress

    monkeypatch.setattr(bm.cli.progress, "PLAIN_INTERVAL_S", 0.0)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"line {i}", "max_tokens": 4}) + "\n" for i in range(5)))
    args = ["run", str(prompts), "-o", str(tmp_path / "out"), "--set", "model.device=cpu"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("bm run [")]
    assert lines and "5/5 requests" in lines[-1], result.output
    pattern = r"bm run \[\d+:\d\d\] \d/5 requests, \d+ output tokens \([\d,]+/s\)(, ETA (\d+:\d\d|\?))?"
    assert all(re.fullmatch(pattern, line) for line in lines), lines
    assert "generating" not in result.output  # no progress bar drawn into the log

    quiet = runner.invoke(app, [*args[:3], str(tmp_path / "quiet"), "-q", *args[4:]])
    assert quiet.exit_code == 0 and "bm run [" not in quiet.output
