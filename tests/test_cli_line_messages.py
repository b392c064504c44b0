"""Messages that name the line, the field and the fix (issue 53, item 8): a number too long to read, a
file of non-breaking spaces, classic-Mac line endings, NUL bytes wherever they are, a control character,
a 50 MB prompt and text prompts on a model without a tokenizer each said something that missed one."""

from __future__ import annotations

import pytest

from bm.workloads.jsonl import read_request_file

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
