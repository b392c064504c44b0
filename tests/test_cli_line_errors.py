"""Smaller truths of the input edge (issue 41, item 14): errors point where the user looks, name what
the user wrote, and keep the user's id; a batch's limits are OpenAI's; ``-o`` is never a file name."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from bm.cli.main import app
from bm.runfiles.openai_batch import BatchLine, iter_batch_file
from bm.runfiles.openai_batch_output import batch_output_line
from bm.workloads.jsonl import read_request_file
from bm.workloads.request import Row


def test_a_line_cut_mid_json_is_reported_where_it_ends(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "abc"\n{"prompt": "x",, "max_tokens": 2}\n')
    cut, doubled = read_request_file(path)
    assert "line ends at column 17" in cut.error and "cut short" in cut.error  # was "at column 1"
    assert "at column 16" in doubled.error


def test_an_unknown_field_keeps_the_users_id(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "keep-me", "prompt": "x", "colour": 1}\n')
    (row,) = read_request_file(path)
    assert "unknown field 'colour'" in row.error and row.user_id == "keep-me"


def batch_line(body, url="/v1/chat/completions", custom_id="c"):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}) + "\n"


def test_temperature_above_openais_limit_is_refused_on_a_batch_line(tmp_path):
    path = tmp_path / "b.jsonl"
    chat = [{"role": "user", "content": "hi"}]
    path.write_text(batch_line({"messages": chat, "temperature": 2.5}) + batch_line({"messages": chat, "temperature": 2}, custom_id="d"))  # fmt: skip
    over, at_limit = iter_batch_file(path)
    assert "body.temperature: 2.5 is above OpenAI's limit of 2" in over.parsed.error
    assert at_limit.parsed.error is None


def test_an_over_long_prompt_error_names_the_field_the_user_wrote():
    """The engine names the prompt input_ids; a chat line's param is messages, a completion's prompt."""
    record = {
        "finish_reason": "error",
        "error": "line 1: input_ids: the prompt (9000 tokens) is longer than 2048",
    }
    for url, param in (("/v1/chat/completions", "messages"), ("/v1/completions", "prompt")):
        line = BatchLine(Row.at_line(1), custom_id="c", url=url)
        out = batch_output_line(0, line, record, "m", 0)
        assert out["response"]["body"]["error"]["param"] == param


def test_dash_o_with_a_file_name_is_refused_with_a_hint(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    result = CliRunner().invoke(app, ["run", str(prompts), "-o", str(tmp_path / "results.jsonl")])
    assert result.exit_code == 2
    assert "names a file" in result.stderr and "results'" in result.stderr
    assert not (tmp_path / "results.jsonl").exists()  # no directory made under a file's name


def test_a_batch_run_points_to_batch_output_jsonl(tmp_path):
    path = tmp_path / "b.jsonl"
    path.write_text(
        batch_line({"prompt": "hello", "max_tokens": 2}, url="/v1/completions")
        + batch_line({"prompt": "x", "temperature": 2.5}, url="/v1/completions", custom_id="hot")
    )
    result = CliRunner().invoke(app, ["run", str(path), "-o", str(tmp_path / "out"), "-q", "--set", "model.device=cpu"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "1 request(s) failed; see their error in batch_output.jsonl" in " ".join(result.stdout.split())


def test_show_puts_each_answer_under_its_own_header(tmp_path):
    """--show ran multi-line answers together: the next id followed the last line of the previous text."""
    from rich.console import Console

    from bm.cli.main import _show_answers

    outputs = tmp_path / "outputs.jsonl"
    records = [{"index": 0, "id": "a", "text": "one\ntwo\n", "error": None}, {"index": 1, "id": "b", "text": "three", "error": None}]  # fmt: skip
    outputs.write_text("".join(json.dumps(r) + "\n" for r in records))
    console = Console(record=True, width=60, color_system=None)
    _show_answers(console, outputs)
    assert console.export_text().splitlines() == ["── a ──", "one", "two", "── b ──", "three"]


def test_an_output_length_error_names_the_field_the_line_wrote(tmp_path):
    """The engine calls the output length request_output_len; the record names what the line wrote
    (max_tokens here), or --max-tokens for a line that took the command's default."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello", "max_tokens": 5000}\n{"prompt": "hello"}\n')
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app,
        ["run", str(prompts), "-o", str(out), "-q", "--max-tokens", "4000", "-s", "model.device=cpu",
         "-s", "engine.max_seq_len=64"],
    )  # fmt: skip
    assert result.exit_code == 3, result.output
    first, second = (json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines())
    assert "max_tokens" in first["error"] and "request_output_len" not in first["error"]
    assert "lower max_tokens to at most" in first["error"]
    assert "--max-tokens" in second["error"] and "request_output_len" not in second["error"]
