"""Run seeds: in ``bm run`` and ``bm bench`` a line without a seed samples with one derived from the run
seed and the line's index, so duplicate lines differ, the same ``--seed`` reproduces a run, and
``--resume`` reuses the seed run.json recorded. An explicit seed stays exact, and the library keeps
TensorRT-LLM's default seed (0)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from bm.bench.replayer import build_requests
from bm.cli.main import app
from bm.engine.requests.request import Request, RequestLimits
from bm.engine.requests.seeds import line_seed
from bm.engine.requests.validate import validate_request
from bm.workloads.request import Row, Workload
from tests.hang import HANG_S
from tests.test_cli_interrupt import (
    MAX_BATCH,
    bm_run_process,
    read_jsonl,
    read_jsonl_lenient,
    wait_for_records,
)

runner = CliRunner()


def sampled_prompts(path, count: int, max_tokens: int = 12, **extra):
    """``count`` identical unseeded lines at temperature 1."""
    line = {"prompt": "Tell me something new", "max_tokens": max_tokens, "temperature": 1.0, **extra}
    path.write_text("".join(json.dumps(line) + "\n" for _ in range(count)))
    return path


def run(prompts, out, *extra):
    args = ["run", str(prompts), "-o", str(out), "-q", "--ignore-eos", "--set", "model.device=cpu", *extra]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return {r["index"]: r for r in read_jsonl(out / "outputs.jsonl")}


def test_duplicate_unseeded_lines_differ(tmp_path):
    records = run(sampled_prompts(tmp_path / "p.jsonl", 4), tmp_path / "out")
    assert len({tuple(r["output_ids"]) for r in records.values()}) == 4
    seed = json.loads((tmp_path / "out" / "run.json").read_text())["seed"]
    assert isinstance(seed, int)  # a random run seed, recorded


def test_the_same_run_seed_twice_gives_identical_output_files(tmp_path):
    prompts = sampled_prompts(tmp_path / "p.jsonl", 6)
    run(prompts, tmp_path / "a", "--seed", "123")
    run(prompts, tmp_path / "b", "--seed", "123")
    assert (tmp_path / "a" / "outputs.jsonl").read_bytes() == (tmp_path / "b" / "outputs.jsonl").read_bytes()
    other = run(prompts, tmp_path / "c", "--seed", "124")
    first = {r["index"]: r["output_ids"] for r in read_jsonl(tmp_path / "a" / "outputs.jsonl")}
    assert {i: r["output_ids"] for i, r in other.items()} != first


def test_an_explicit_seed_stays_exact_whatever_the_run_seed(tmp_path):
    prompts = sampled_prompts(tmp_path / "p.jsonl", 2, seed=7)
    a = run(prompts, tmp_path / "a", "--seed", "1")
    b = run(prompts, tmp_path / "b", "--seed", "2")
    assert a[0]["output_ids"] == a[1]["output_ids"] == b[0]["output_ids"]  # seed 7 each time


def test_resume_refuses_another_run_seed(tmp_path):
    prompts = sampled_prompts(tmp_path / "p.jsonl", 2)
    run(prompts, tmp_path / "out", "--seed", "5")
    args = ["run", str(prompts), "-o", str(tmp_path / "out"), "--resume", "--seed", "6", "--ignore-eos"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and "the run seed changed" in result.output, result.output


def test_resume_after_sigkill_gives_the_outputs_of_an_uninterrupted_run_with_that_seed(tmp_path):
    n = 16
    prompts = sampled_prompts(tmp_path / "p.jsonl", n, max_tokens=24)
    reference = tmp_path / "reference"
    done = bm_run_process(prompts, reference, "--seed", "77")
    assert done.wait(timeout=HANG_S) == 0, done.communicate()
    expected = {r["index"]: r["output_ids"] for r in read_jsonl(reference / "outputs.jsonl")}
    assert len({tuple(ids) for ids in expected.values()}) == n

    out = tmp_path / "out"
    proc = bm_run_process(prompts, out, "--seed", "77")
    wait_for_records(proc, out / "outputs.jsonl", MAX_BATCH)
    proc.kill()  # SIGKILL: no handler, no summary
    proc.wait()
    assert len(read_jsonl_lenient(out / "outputs.jsonl")) < n
    resumed = bm_run_process(prompts, out, "--resume")  # no --seed: run.json's is reused
    _stdout, stderr = resumed.communicate(timeout=HANG_S)
    assert resumed.returncode == 0, stderr
    records = read_jsonl(out / "outputs.jsonl")
    assert sorted(r["index"] for r in records) == list(range(n))
    assert {r["index"]: r["output_ids"] for r in records} == expected


def test_bench_rows_without_a_seed_get_one_from_the_run_seed():
    rows = [Row(f"line {i}", input_ids=[5, 6, 7], max_tokens=4) for i in range(3)]
    rows.append(Row("line 4", input_ids=[5, 6, 7], max_tokens=4, fields={"seed": 9}))
    built = dict(build_requests(Workload("bm", "x", rows), None, run_seed=3))
    assert [built[i].random_seed for i in range(3)] == [line_seed(3, i) for i in range(3)]
    assert len({built[i].random_seed for i in range(3)}) == 3
    assert built[3].random_seed == 9


def test_the_library_keeps_tensorrt_llms_default_seed():
    limits = RequestLimits(vocab_size=100, max_seq_len=64, max_num_tokens=None, max_beam_width=1)
    request = validate_request(Request(1, [5, 6], 4, temperature=1.0), limits)
    assert request.sampling.random_seed == 0
