"""Exit codes of ``bm run`` and ``bm bench`` (issue 26, defect 3): a run where no request succeeded is
not a success, an input that cannot run is refused before the model loads, and the shipped HF sample
is read as the HF table it is."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from bm.cli.exit_codes import INTERRUPTED, NO_SUCCESS, OK, USAGE, run_exit_code
from bm.cli.main import app
from bm.workloads import detect_kind
from tests.conftest import REPO

runner = CliRunner()
SAMPLES = REPO / "datasets"


def invoke(command, *args):
    return runner.invoke(app, [command, *map(str, args), "--quiet", "--set", "model.device=cpu"])


def write_lines(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_exit_code_separates_success_no_success_and_interrupt():
    assert run_exit_code(12, 12, interrupted=False) == OK == 0
    assert run_exit_code(12, 1, interrupted=False) == OK  # failed ones carry their error in the records
    assert run_exit_code(12, 0, interrupted=False) == NO_SUCCESS == 3
    assert run_exit_code(12, 0, interrupted=True) == INTERRUPTED == 130
    assert NO_SUCCESS != USAGE == 2


def test_bm_run_where_every_request_fails_exits_3(tmp_path):
    prompts = write_lines(tmp_path / "p.jsonl", [{"input_ids": [99999], "max_tokens": 2}] * 2)
    result = invoke("run", prompts, "-o", tmp_path / "out")
    assert result.exit_code == NO_SUCCESS, result.output
    assert "no request succeeded" in result.output
    records = [json.loads(line) for line in (tmp_path / "out" / "outputs.jsonl").read_text().splitlines()]
    assert [r["finish_reason"] for r in records] == ["error", "error"]


def test_bm_run_with_one_good_request_among_failures_exits_0(tmp_path):
    prompts = write_lines(
        tmp_path / "p.jsonl",
        [{"input_ids": [99999], "max_tokens": 2}, {"input_ids": [5, 6], "max_tokens": 2}],
    )
    result = invoke("run", prompts, "-o", tmp_path / "out")
    assert result.exit_code == OK, result.output
    assert "1 request(s) failed" in result.output


def test_bm_bench_where_every_request_fails_exits_3(tmp_path):
    dataset = write_lines(tmp_path / "d.jsonl", [{"input_ids": [99999], "max_tokens": 2}] * 2)
    result = invoke("bench", dataset, "-o", tmp_path / "out")
    assert result.exit_code == NO_SUCCESS, result.output
    assert json.loads((tmp_path / "out" / "results.json").read_text())["completed"] == 0


@pytest.mark.parametrize("content", ["", "\n  \n"])
def test_an_empty_prompts_file_is_refused_before_the_model_loads(tmp_path, content):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(content)
    result = invoke("run", prompts, "-o", tmp_path / "out")
    assert result.exit_code == USAGE and "holds no request" in result.output
    assert not (tmp_path / "out").exists()  # refused before -o was even made
    result = invoke("bench", prompts, "-o", tmp_path / "bench")
    assert result.exit_code == USAGE and "no requests" in result.output
    assert "loading model" not in result.output


def test_the_shipped_hf_sample_is_detected_as_hf_and_names_its_columns(tmp_path):
    sample = SAMPLES / "bench" / "hf-qa.jsonl"
    assert detect_kind(sample) == "hf"
    result = invoke("bench", sample, "-o", tmp_path / "out")
    assert result.exit_code == USAGE
    assert "no column 'prompt' (--prompt-column); it has question, answer" in result.output
    assert "loading model" not in result.output


def test_prompt_column_switches_the_shipped_hf_sample_and_it_runs(tmp_path):
    sample = SAMPLES / "bench" / "hf-qa.jsonl"
    result = invoke(
        "bench",
        sample,
        "--prompt-column",
        "question",
        "--output-column",
        "answer",
        "-n",
        "3",
        "-o",
        tmp_path / "o",
    )
    assert result.exit_code == OK, result.output
    results = json.loads((tmp_path / "o" / "results.json").read_text())
    assert results["completed"] == 3 and results["failed"] == 0


def test_detection_keeps_bm_lines_and_a_column_named_by_prompt_column(tmp_path):
    assert detect_kind(write_lines(tmp_path / "a.jsonl", [{"prompt": "x", "max_tokens": 2}])) == "bm"
    # a typo in a bm line stays a bm line (its error suggests the field) while it has a bm field
    assert detect_kind(write_lines(tmp_path / "b.jsonl", [{"promt": "x", "max_tokens": 2}])) == "bm"
    assert detect_kind(write_lines(tmp_path / "c.jsonl", [{"id": 1, "text": "x"}])) == "hf"
    assert (
        detect_kind(write_lines(tmp_path / "d.jsonl", [{"prompt": "x", "max_tokens": 2}]), "prompt") == "bm"
    )
    # --prompt-column naming a column of the file picks hf even where bm's fields are present too
    rows = [{"question": "x", "max_tokens": 2}]
    assert detect_kind(write_lines(tmp_path / "e.jsonl", rows), "question") == "hf"


def test_a_chat_file_under_bench_for_a_model_without_a_chat_template_exits_2_naming_the_flag(tmp_path):
    """bm bench replays chats through the chat template (tests/test_bench_defaults.py); the embedded
    model has none, which is known once it has loaded: no row can run, so nothing is replayed."""
    result = invoke("bench", SAMPLES / "chat.jsonl", "-o", tmp_path / "out")
    assert result.exit_code == USAGE
    assert "none of its 12 rows can run" in result.output and "--chat-template FILE" in result.output
    assert not (tmp_path / "out" / "results.json").exists()
