"""What users pipe into ``bm run`` is read, and what can never run is refused before the model loads.

Issue 41: ``head -2 p.jsonl | bm run /dev/stdin`` ran 0 requests and exited 0 (run.json recorded the
digest of empty input), ``bm run -`` said the file ``-`` did not exist, a gzip file got "save the file as
UTF-8", and binary junk, a CSV trace or a file of only bad lines loaded the model before failing."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import sys
import threading

import pytest
from typer.testing import CliRunner

from bm.cli.main import app
from tests.conftest import REPO
from tests.hang import HANG_S

runner = CliRunner()
LINES = b'{"id": "a", "prompt": "hello there", "max_tokens": 3}\n{"id": "b", "prompt": "good bye", "max_tokens": 3}\n'
CPU = ["--set", "model.device=cpu", "-q"]


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def assert_ran_both_lines(out):
    records = read_jsonl(out / "outputs.jsonl")
    assert sorted(r["id"] for r in records) == ["a", "b"]
    assert all(r["error"] is None and r["num_output_tokens"] == 3 for r in records)
    # run.json's digest is of the bytes the run read, so --resume can match them
    identity = json.loads((out / "run.json").read_text())
    assert identity["prompts_sha256"] == hashlib.sha256(LINES).hexdigest()
    return identity


def test_run_reads_prompts_piped_on_stdin(tmp_path):
    """``bm run -`` (in process) and ``bm run /dev/stdin`` (a real pipe, in a shell)."""
    out = tmp_path / "dash"
    result = runner.invoke(app, ["run", "-", "-o", str(out), *CPU], input=LINES)
    assert result.exit_code == 0, result.output
    assert assert_ran_both_lines(out)["prompts"] == "-"

    piped = tmp_path / "devstdin"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    command = f"printf '%s' '{LINES.decode()}' | {sys.executable} -m bm run /dev/stdin -o {piped} -q --set model.device=cpu"  # fmt: skip
    proc = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert assert_ran_both_lines(piped)["prompts"] == "/dev/stdin"


def invoke_on_a_pipe(command: str, out) -> object:
    """``bm COMMAND <(...)``: the CLI reads a pipe under /dev/fd that a thread is writing the lines to."""
    read_end, write_end = os.pipe()

    def feed():
        with os.fdopen(write_end, "wb") as f:
            f.write(LINES)

    writer = threading.Thread(target=feed)
    writer.start()
    try:
        return runner.invoke(app, [command, f"/dev/fd/{read_end}", "-o", str(out), *CPU])
    finally:
        writer.join()
        os.close(read_end)


def test_run_reads_a_process_substitution(tmp_path):
    """``bm run <(...)`` names a pipe under /dev/fd: read once, completely."""
    out = tmp_path / "out"
    result = invoke_on_a_pipe("run", out)
    assert result.exit_code == 0, result.output
    assert_ran_both_lines(out)


@pytest.mark.parametrize("name", ["p.jsonl.gz", "p.jsonl"])  # gzip is found by its magic bytes, not the name
def test_run_reads_gzipped_prompts(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(gzip.compress(LINES))
    out = tmp_path / "out"
    result = runner.invoke(app, ["run", str(path), "-o", str(out), *CPU])
    assert result.exit_code == 0, result.output
    assert assert_ran_both_lines(out)["prompts"] == str(path)
    # the same lines uncompressed resume the gzip run: the digest is of the text
    resumed = runner.invoke(app, ["run", str(path), "-o", str(out), "--resume", *CPU])
    assert resumed.exit_code == 0, resumed.output
    assert len(read_jsonl(out / "outputs.jsonl")) == 2


PROBE = """
import sys
from typer.testing import CliRunner
from bm.cli.main import app
result = CliRunner().invoke(app, sys.argv[1:])
print("EXIT", result.exit_code)
print("HEAVY", sorted(m for m in ("torch", "transformers") if m in sys.modules))
print("STDOUT", repr(result.stdout))
print("STDERR", " ".join(result.stderr.split()))
"""

NEVER_RUNNABLE = [
    ("junk.bin", bytes(range(256)) * 16, "is binary data"),
    ("broken.jsonl.gz", gzip.compress(LINES)[:25], "does not decompress"),
    (
        "trace.csv",
        b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n",
        "is a CSV table",
    ),
    (
        "bad.jsonl",
        b'{"prompt": 1}\n{"colour": 2}\n{"prompt": "unterminated\n',
        "none of its 3 line(s) can run",
    ),
    ("latin1.jsonl", b'{"prompt": "caf\xe9"}\n', "not UTF-8 text"),
    (
        "dup.jsonl",
        b"".join(
            json.dumps(
                {"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"}}
            ).encode()
            + b"\n"
            for _ in range(2)
        ),
        "custom_id 'x' is also on line 1",
    ),
]


@pytest.mark.parametrize("name, data, message", NEVER_RUNNABLE, ids=[n for n, _, _ in NEVER_RUNNABLE])
def test_a_file_with_no_runnable_line_is_refused_before_the_model_loads(tmp_path, name, data, message):
    """Exit 2 (docs/exit-codes.md), on stderr, naming the file and the fix; torch is never imported and
    no -o directory is left behind."""
    path = tmp_path / name
    path.write_bytes(data)
    out = tmp_path / "out"
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, "run", str(path), "-o", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=HANG_S,
    )
    assert "EXIT 2" in proc.stdout, proc.stdout + proc.stderr
    assert "HEAVY []" in proc.stdout, proc.stdout
    assert "STDOUT ''" in proc.stdout  # nothing on stdout: the error is on stderr
    stderr = proc.stdout.split("STDERR ", 1)[1]
    assert message in stderr and name in stderr, stderr
    assert not out.exists()


def test_a_file_with_one_runnable_line_runs_and_the_bad_lines_get_records(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": 1}\n{"prompt": "fine", "max_tokens": 2}\n')
    out = tmp_path / "out"
    result = runner.invoke(app, ["run", str(path), "-o", str(out), *CPU])
    assert result.exit_code == 0, result.output
    assert [r["finish_reason"] == "error" for r in read_jsonl(out / "outputs.jsonl")].count(True) == 1


def test_bm_run_dash_with_nothing_piped_is_a_usage_error(tmp_path):
    result = runner.invoke(app, ["run", "-", "-o", str(tmp_path / "out")], input=b"")
    assert result.exit_code == 2
    assert "holds no request" in result.stderr and result.stdout == ""


# bm bench, compare and sweep read their dataset through the same copy of a pipe or a gzip file.
BATCH = b"".join(
    json.dumps(
        {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": {"prompt": f"hi {i}", "max_tokens": 3}}
    ).encode()
    + b"\n"
    for i in range(2)
)  # fmt: skip
AZURE = b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,5,3\n2023-11-16 18:15:47.01,4,3\n"


@pytest.mark.parametrize(
    "kind, name, data",
    [("bm", "data.jsonl", LINES), ("openai-batch", "batch.jsonl", BATCH), ("azure", "trace.csv", AZURE)],
)
def test_bench_reads_a_piped_or_gzipped_dataset_as_it_reads_the_named_file(tmp_path, kind, name, data):
    """Issue 41: ``bm bench -`` said the file ``-`` did not exist and ``.jsonl.gz`` was not read. Piped
    and gzipped, each kind is detected and replayed exactly as the named file is, and results.json names
    the input as the user gave it (not bm's private copy)."""
    named = tmp_path / name
    named.write_bytes(data)
    zipped = tmp_path / f"{name}.gz"
    zipped.write_bytes(gzip.compress(data))
    results = {}
    for label, dataset, piped in (("named", named, None), ("dash", "-", data), ("gzip", zipped, None)):
        out = tmp_path / label
        result = runner.invoke(app, ["bench", str(dataset), "-o", str(out), *CPU], input=piped)
        assert result.exit_code == 0, result.output
        results[label] = json.loads((out / "results.json").read_text())
    for got in results.values():
        assert got["dataset"]["kind"] == kind and got["completed"] == 2
        assert got["total_output_tokens"] == results["named"]["total_output_tokens"]
    assert results["dash"]["dataset"]["path"] == "-"
    assert results["gzip"]["dataset"]["path"] == str(zipped)


def test_bench_reads_a_process_substitution(tmp_path):
    out = tmp_path / "out"
    result = invoke_on_a_pipe("bench", out)
    assert result.exit_code == 0, result.output
    assert json.loads((out / "results.json").read_text())["completed"] == 2


def test_bench_refuses_a_piped_or_gzipped_table_for_hugging_face_datasets_naming_the_fix(tmp_path):
    """The hf kind is read by Hugging Face ``datasets`` from a named file; a gzip file or a pipe of one is
    refused before torch loads, saying to save it uncompressed."""
    table = b'{"question": "hi", "answer": "there"}\n'
    zipped = tmp_path / "table.jsonl.gz"
    zipped.write_bytes(gzip.compress(table))
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    for extra in ([], ["--dataset-kind", "hf", "--prompt-column", "question"]):
        proc = subprocess.run(
            [sys.executable, "-c", PROBE, "bench", str(zipped), "-o", str(tmp_path / "out"), *extra],
            capture_output=True,
            text=True,
            env=env,
            timeout=HANG_S,
        )
        assert "EXIT 2" in proc.stdout and "HEAVY []" in proc.stdout, proc.stdout + proc.stderr
        stderr = proc.stdout.split("STDERR ", 1)[1]
        assert f"dataset {str(zipped)!r} is read as a Hugging Face table" in stderr, stderr
        assert "save it uncompressed" in stderr and "bm-input-" not in stderr  # never the copy's name
    piped = runner.invoke(app, ["bench", "-", "-o", str(tmp_path / "out2")], input=table)
    assert piped.exit_code == 2 and "dataset '-' is read as a Hugging Face table" in piped.stderr


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "dataset '-' is empty"),
        (b"  \n\n", "dataset '-' is empty"),
        (b"TIMESTAMP,Foo\n1,2\n", "-: cannot tell the kind of this CSV from its columns"),
    ],
)
def test_bench_on_a_pipe_that_cannot_be_read_names_the_input_and_the_fix(tmp_path, data, message):
    result = runner.invoke(app, ["bench", "-", "-o", str(tmp_path / "out")], input=data)
    assert result.exit_code == 2, result.output
    error = " ".join(result.stderr.split())
    assert message in error and "bm-input-" not in error and "loading model" not in result.output
