"""Messages that name the line, the field and the fix (issue 53, item 8): a number too long to read, a
file of non-breaking spaces, classic-Mac line endings, NUL bytes wherever they are, a control character,
a 50 MB prompt and text prompts on a model without a tokenizer each said something that missed one."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bm.runfiles.prompts import Codec, to_request
from bm.runfiles.source import PromptsFileError, open_prompts
from bm.workloads.jsonl import read_request_file
from tests.conftest import REPO
from tests.hang import HANG_S

GOOD = b'{"prompt": "hello", "max_tokens": 2}\n'


def one_error(tmp_path, raw: bytes) -> str:
    path = tmp_path / "p.jsonl"
    path.write_bytes(raw)
    (row,) = read_request_file(path)
    assert row.error is not None
    return row.error


@pytest.mark.parametrize(
    "raw, field",
    [
        (b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}\n", "seed"),
        (b'{"input_ids": [5, ' + b"7" * 5000 + b"]}\n", "input_ids[1]"),
    ],
)
def test_a_number_too_long_to_read_names_its_field_and_the_fix(tmp_path, raw, field):
    """It was "unreadable JSON (ValueError)": Python reads integers of at most 4300 digits."""
    error = one_error(tmp_path, raw)
    assert error.startswith(f"line 1: {field}: a 5000-digit integer"), error
    assert "ValueError" not in error and "4300" in error


def test_a_number_too_long_for_a_field_says_the_fields_range(tmp_path):
    error = one_error(tmp_path, b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}\n")
    assert "18446744073709551615" in error  # the range seed takes


def test_a_control_character_in_a_string_is_named_once_with_its_escape(tmp_path):
    """It was "Invalid control character at at column 14"."""
    error = one_error(tmp_path, b'{"prompt": "a\x01b", "max_tokens": 2}\n')
    assert "at at" not in error
    assert "U+0001 at column 14" in error and "\\u0001" in error, error


def test_a_non_breaking_space_outside_a_string_is_named_with_the_fix(tmp_path):
    error = one_error(tmp_path, '\u00a0{"prompt": "x"}\n'.encode())
    assert "U+00A0" in error and "column 1" in error and "plain space" in error, error


def test_lines_that_ran_together_say_so(tmp_path):
    error = one_error(tmp_path, b'{"prompt": "a"} {"prompt": "b"}\n')
    assert "one JSON object per line" in error and "column 17" in error, error


def test_classic_mac_line_endings_are_named_with_the_command_that_converts_them(tmp_path):
    """A lone CR is not a line end in JSONL: the file is one line, which said "Extra data at column 44"."""
    error = one_error(tmp_path, b'{"prompt": "hello there", "max_tokens": 2}\r{"prompt": "second"}\r')
    assert "CR" in error and "tr '\\r' '\\n'" in error, error


NUL_LINE = b'{"prompt": "a\x00b", "max_tokens": 2}\n'


@pytest.mark.parametrize("before", [0, 1, 200], ids=["first line", "second line", "past 4 KB"])
def test_a_nul_byte_is_its_lines_error_wherever_it_is_in_the_file(tmp_path, before):
    """A NUL in the first 4 KB refused the whole file; past it, only its line: now always its line."""
    path = tmp_path / "p.jsonl"
    path.write_bytes(GOOD * before + NUL_LINE + GOOD * 3)
    rows = read_request_file(path)
    bad = [row for row in rows if row.error is not None]
    assert len(rows) == before + 4 and [row.index for row in bad] == [before]
    assert bad[0].error.startswith(
        f"line {before + 1}: a NUL byte (0x00) at column 14, which is not text; remove it"
    )
    assert open_prompts(path).path == path  # the other lines run: no whole-file refusal


def test_a_file_of_nul_lines_only_is_still_refused_as_binary(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(NUL_LINE * 3)
    with pytest.raises(PromptsFileError, match="is binary data"):
        open_prompts(path)


PROBE = """
import sys
from typer.testing import CliRunner
from bm.cli.main import app
result = CliRunner().invoke(app, sys.argv[1:])
print("EXIT", result.exit_code)
print("HEAVY", sorted(m for m in ("torch", "transformers") if m in sys.modules))
print("STDERR", " ".join(result.stderr.split()))
"""


def probe(tmp_path, *args):
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, "run", *map(str, args), "-o", str(tmp_path / "out")],
        capture_output=True, text=True, env=env, timeout=HANG_S, cwd=REPO,
    )  # fmt: skip
    assert "EXIT 2" in proc.stdout, proc.stdout + proc.stderr
    assert "HEAVY []" in proc.stdout, proc.stdout  # refused before torch loads, so before the model
    assert not (tmp_path / "out").exists()
    return proc.stdout.split("STDERR ", 1)[1]


def test_a_file_of_non_breaking_spaces_is_refused_as_holding_no_request(tmp_path):
    """It said "none of its 0 line(s) can run; the first: None"."""
    path = tmp_path / "p.jsonl"
    path.write_text("\u00a0\u00a0\u00a0\n\u00a0\n", encoding="utf-8")
    stderr = probe(tmp_path, path)
    assert "holds no request" in stderr and "None" not in stderr, stderr


def test_text_prompts_on_a_model_without_a_tokenizer_are_refused_before_it_loads(tmp_path):
    """A random-weight --model-config has no tokenizer: its text lines were found after the load (exit 3)."""
    path = tmp_path / "p.jsonl"
    path.write_bytes(GOOD + b'{"messages": [{"role": "user", "content": "hi"}]}\n')
    stderr = probe(tmp_path, path, "--model-config", "configs/models/bench-llama-15m.json")
    assert "none of its 2 line(s) can run" in stderr, stderr
    assert "line 1: prompt: this model has no tokenizer" in stderr and "input_ids" in stderr
    assert "model.tokenizer" in stderr  # the other fix: give the model a tokenizer


def test_a_model_without_a_tokenizer_still_runs_a_file_with_one_token_id_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(GOOD + b'{"input_ids": [5, 6], "max_tokens": 2}\n')
    assert open_prompts(path, has_tokenizer=False).path == path


def test_stop_strings_on_a_model_without_a_tokenizer_name_the_token_id_form(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"input_ids": [5, 6], "stop": "x"}\n')
    with pytest.raises(PromptsFileError, match=r"line 1: stop: .*no tokenizer.*stop_words_list"):
        open_prompts(path, has_tokenizer=False)


class CountingEncoder:
    """A byte-level encoder that remembers the longest text it was handed."""

    def __init__(self, chars_per_token: int = 1) -> None:
        self.longest = 0
        self.chars_per_token = chars_per_token

    def __call__(self, text: str) -> list[int]:
        self.longest = max(self.longest, len(text))
        return [7] * max(1, len(text) // self.chars_per_token)


def row_of(tmp_path, line: dict):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(line) + "\n")
    (row,) = read_request_file(path)
    return row


def test_a_prompt_far_over_the_maximum_is_refused_before_it_is_tokenized_naming_prompt(tmp_path):
    """A 50 MB line was tokenized whole (1.5 GB, 41 s) and its error named input_ids."""
    row = row_of(tmp_path, {"prompt": "hello world " * 500_000})  # 6 MB
    encode = CountingEncoder()
    assert to_request(row, Codec(encode=encode, max_prompt_tokens=2048), 4, None) is None
    assert row.error.startswith("line 1: prompt: the prompt has at least "), row.error
    assert "longer than the model's maximum of 2048" in row.error and "input_ids" not in row.error
    assert encode.longest <= 8 * 2048  # a bounded prefix, not the 6 MB text


def test_a_long_prompt_of_few_tokens_is_tokenized_whole_and_runs(tmp_path):
    """Only a certain refusal is early: a text can have far fewer tokens than characters."""
    text = " " * 100_000
    row = row_of(tmp_path, {"prompt": text})
    encode = CountingEncoder(chars_per_token=100)  # 1,000 tokens: within the maximum
    request = to_request(row, Codec(encode=encode, max_prompt_tokens=2048), 4, None)
    assert request is not None and len(request.input_ids) == 1000 and encode.longest == len(text)


def test_the_engines_length_error_names_the_field_the_line_used(tmp_path):
    from bm.runfiles.records import in_line_terms

    message = "input_ids: the prompt has 9000 tokens, longer than the model's maximum of 2048"
    text = row_of(tmp_path, {"prompt": "x"})
    chat = row_of(tmp_path, {"messages": [{"role": "user", "content": "x"}]})
    ids = row_of(tmp_path, {"input_ids": [1]})
    assert in_line_terms(message, text).startswith("prompt: the prompt has 9000")
    assert in_line_terms(message, chat).startswith("messages: the prompt has 9000")
    assert in_line_terms(message, ids) == message
    drafts = "draft_input_ids: not supported with beam_width > 1"
    assert in_line_terms(drafts, text) == drafts  # only the prompt's own field is renamed
