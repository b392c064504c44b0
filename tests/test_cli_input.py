"""Input that never crashes a run: every hostile line becomes one record naming its line and field, and
every unusable file or directory is one usage error (exit 2) before anything loads."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from bm.cli.main import app
from bm.engine.requests.request import Request
from bm.workloads.jsonl import REQUEST_FIELDS, read_request_file
from tests.conftest import REPO
from tests.hang import HANG_S

runner = CliRunner()


def run_cli(*args):
    return runner.invoke(app, [*map(str, args)])


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# (raw line bytes, None for a line that must run, else a substring its error must hold)
HOSTILE = [
    ('\ufeff{"id": "bom", "prompt": "a BOM before line 1", "max_tokens": 2}'.encode(), None),
    (b'{"prompt": "caf\xe9 in Latin-1"}', "not UTF-8 text"),
    (b'{"prompt": "\\ud800 lone surrogate"}', "prompt: contains a lone UTF-16 surrogate"),
    (b'{"id": "\\udfff"}', "id: contains a lone UTF-16 surrogate"),
    (b"[" * 100_000 + b"]" * 100_000, "nested"),
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested"),
    (b'{"prompt": "x", "beam_width": 1.9}', "beam_width: expected an integer"),
    (b'{"prompt": "x", "runtime_top_k": 2.7}', "runtime_top_k: expected an integer"),
    (b'{"prompt": "x", "end_id": 2.9}', "end_id: expected an integer"),
    (b'{"prompt": "x", "return_log_probs": 5}', "return_log_probs: expected true or false"),
    (b'{"prompt": "x", "streaming": 0.5}', "streaming: expected true or false"),
    (b'{"prompt": "x", "temperature": true}', "temperature: expected a finite number"),
    (b'{"prompt": "x", "temperature": NaN}', "temperature: expected a finite number"),
    (b'{"prompt": "x", "max_tokens": 1e30}', "max_tokens: expected an integer"),
    (b'{"prompt": "x", "max_tokens": 4.0}', "max_tokens: expected an integer"),
    (b'{"prompt": "x", "seed": -1}', "seed: must be at least 0"),
    (b'{"prompt": "x", "seed": 1e30}', "seed: expected an integer"),
    (b'{"input_ids": [5, 99999999999]}', "input_ids: token id 99999999999"),
    (b'{"input_ids": [5, -3]}', "input_ids: token id -3"),
    (b'{"input_ids": [5, 300]}', "input_ids: token id 300 is outside the vocabulary"),
    (b'{"prompt": "x", "embedding_bias": [1.0, 2.0]}', "embedding_bias: expected 259 numbers"),
    (b'{"prompt": "x", "stop_words_list": "stop"}', "stop_words_list: expected a list"),
    (b'{"prompt": "x", "temperature": -1}', "temperature"),  # refused by the engine, not the parser
    (b'{"prompt": "x", "beam_width": 2}', "beam_width"),  # above engine.max_beam_width: the engine
    (b'{"messages": [{"role": "user", "content": "hi"}]}', "messages: this model has no chat template"),
    (b'{"messages": [{"role": "user"}]}', "messages[0].content"),
    (b'{"prompt": "x", "stop": 7}', "stop: expected a non-empty string"),
    (b'{"id": [1], "prompt": "x"}', "id: expected a string or an integer"),
    (b'{"id": "bom", "prompt": "again"}', "duplicate id"),
    (b"[1, 2]", "expected a JSON object, got list"),
    (b"null", "expected a JSON object, got NoneType"),
    (b'{"prompt": "unterminated', "malformed JSON"),
    (b"{}", "missing prompt"),
    (b'{"prompt": "x", "colour": 1}', "unknown field 'colour'"),
    (json.dumps({"prompt": "y" * 200_000, "max_tokens": 2}).encode(), "longer than"),
    (b'{"prompt": "x", "stop_words_list": ["x", [5, 6]], "max_tokens": 3}', None),
    (b'{"prompt": "nul \\u0000 byte", "max_tokens": 2}', None),
]


def test_every_hostile_line_gets_exactly_one_record_naming_its_line_and_no_traceback(tmp_path):
    prompts = tmp_path / "hostile.jsonl"
    prompts.write_bytes(b"\n".join(raw for raw, _ in HOSTILE) + b"\n")
    out = tmp_path / "out"
    result = run_cli("run", prompts, "-o", out, "-q", "--set", "model.device=cpu", "--max-tokens", "3")
    assert result.exit_code == 0, result.output
    assert result.exception is None and "Traceback" not in result.output
    records = {r["index"]: r for r in read_jsonl(out / "outputs.jsonl")}
    assert sorted(records) == list(range(len(HOSTILE)))  # exactly one record per line
    for index, (_raw, expected) in enumerate(HOSTILE):
        record = records[index]
        if expected is None:
            assert record["error"] is None, record
            assert record["finish_reason"] in ("length", "stop")
        else:
            assert record["finish_reason"] == "error"
            assert record["error"].startswith(f"line {index + 1}: "), record["error"]
            assert expected in record["error"], record["error"]
            assert len(record["error"]) < 2000  # a 200 KB prompt never becomes a 200 KB message
    assert records[0]["id"] == "bom"
    summary = json.loads((out / "summary.json").read_text())
    ran = [r for r in records.values() if r["finish_reason"] != "error"]
    # the refused 200 KB prompt (and every other failed line) adds nothing to the token counts
    assert summary["num_prompt_tokens"] == sum(r["num_prompt_tokens"] for r in ran)
    assert summary["num_output_tokens"] == sum(r["num_output_tokens"] for r in ran)
    assert summary["num_failed"] == sum(1 for _, e in HOSTILE if e is not None)


def test_wrong_types_are_refused_never_coerced_by_the_shared_parser(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        "\n".join(
            json.dumps({"prompt": "x", field: value})
            for field, value in [
                ("beam_width", 1.9),
                ("beam_width", True),
                ("temperature", True),
                ("temperature", "0.5"),
                ("return_log_probs", 1),
                ("early_stopping", 1.0),
                ("random_seed", 2**64),
                ("top_p", None),  # null means "not given"
            ]
        )
    )
    lines = read_request_file(path)
    assert [line.ok for line in lines] == [False] * 7 + [True]
    assert lines[-1].fields == {}


def test_the_parser_knows_every_request_field_the_engine_supports():
    engine_fields = {f.name for f in dataclasses.fields(Request)}
    assert set(REQUEST_FIELDS) == engine_fields - {
        "request_id",
        "input_ids",
        "request_output_len",
        "logits_post_processor",
    }


def test_bm_run_and_bm_bench_read_the_same_file_the_same_way(tmp_path):
    """stop_words_list used to run under bm run and be refused by bm bench: one parser now serves both."""
    from bm.config import BenchConfig
    from bm.workloads import load_workload

    path = tmp_path / "p.jsonl"
    path.write_text(
        json.dumps({"prompt": "hi", "stop_words_list": ["a", [7, 8]], "top_k": 3, "max_tokens": 4})
        + "\n"
        + json.dumps({"prompt": "hi", "beam_width": 1.9})
        + "\n"
    )
    encode = lambda text: [ord(c) for c in text]  # noqa: E731
    workload = load_workload(BenchConfig(dataset=str(path)), vocab_size=300, encode=encode)
    good, bad = workload.requests
    assert good.ok and good.fields == {"stop_words_list": [[97], [7, 8]], "runtime_top_k": 3}
    assert bad.error == read_request_file(path)[1].error


@pytest.mark.parametrize(
    "make_args, message",
    [
        (lambda t: ["run", t], "is a directory"),
        (lambda t: ["run", t / "missing.jsonl"], "does not exist"),
        (lambda t: ["run", t / "p.jsonl", "-c", t / "binary.yaml"], "is not a YAML text file"),
        (lambda t: ["run", t / "p.jsonl", "-c", t], "is a directory"),
        (lambda t: ["run", t / "p.jsonl", "-o", t / "p.jsonl"], "is a file"),
        (lambda t: ["run", t / "p.jsonl", "-o", t / "p.jsonl" / "sub"], "cannot create the directory"),
        (lambda t: ["run", t / "p.jsonl", "--chat-template", t / "missing.jinja"], "no such file"),
        (lambda t: ["bench", t / "p.jsonl", "-o", t / "p.jsonl"], "is a file"),
        (lambda t: ["compare", t / "p.jsonl", "--baseline", t / "binary.yaml"], "not UTF-8"),
        (lambda t: ["compare", t / "p.jsonl", "--baseline", t / "garbage.json"], "variants.v1"),
        (lambda t: ["compare", t / "p.jsonl", "-o", t / "p.jsonl"], "is a file"),
    ],
)
def test_unusable_files_and_directories_are_one_usage_error_before_the_run(tmp_path, make_args, message):
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    (tmp_path / "binary.yaml").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "garbage.json").write_text('{"variants": {"v1": "garbage"}}')
    result = run_cli(*make_args(tmp_path))
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert result.exception is None or isinstance(result.exception, SystemExit)


VALIDATION_PROBE = """
import sys
from typer.testing import CliRunner
from bm.cli.main import app
result = CliRunner().invoke(app, sys.argv[1:])
print("EXIT", result.exit_code)
print("HEAVY", sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""


@pytest.mark.parametrize(
    "make_args",
    [
        lambda t: ["run", t / "p.jsonl", "--set", "engine.max_batch_sise=4"],
        lambda t: ["run", t / "p.jsonl", "-c", t / "binary.yaml"],
        lambda t: ["run", t],
        lambda t: ["run", t / "p.jsonl", "-o", t / "p.jsonl"],
        lambda t: ["run", t / "p.jsonl", "-o", t / "full"],
        lambda t: ["bench", t / "missing.jsonl"],
        lambda t: ["bench", t / "p.jsonl", "--set", "bench.warmup=-1"],
        lambda t: ["compare", t / "p.jsonl", "--baseline", t / "binary.yaml"],
        lambda t: ["compare", t / "p.jsonl", "--schemes", "v1,bogus"],
        lambda t: ["compare", t / "p.jsonl", "--assert", "v1.output_throughput >>> 2"],
    ],
)
def test_usage_config_and_file_errors_are_found_before_torch_loads(tmp_path, make_args):
    """Fast failure, checked by what was imported (not by a clock): torch takes seconds to load."""
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    (tmp_path / "binary.yaml").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "outputs.jsonl").write_text("{}\n")
    args = [str(a) for a in make_args(tmp_path)]
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", VALIDATION_PROBE, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=HANG_S,
    )
    assert "EXIT 2" in proc.stdout, proc.stdout + proc.stderr
    assert "HEAVY []" in proc.stdout, proc.stdout


def test_bm_bench_names_the_line_of_an_error_the_engine_found(tmp_path):
    dataset = tmp_path / "d.jsonl"
    dataset.write_text('{"prompt": "fine", "max_tokens": 2}\n{"prompt": "x", "temperature": -1}\n')
    out = tmp_path / "out"
    result = run_cli("bench", dataset, "-o", out, "-q", "--set", "model.device=cpu")
    assert result.exit_code == 0, result.output
    records = read_jsonl(out / "requests.jsonl")
    errors = [r["error"] for r in records if r["error"]]
    assert len(errors) == 1 and errors[0].startswith("line 2: ") and "temperature" in errors[0]
