"""A field's value is judged by one table, whichever door it comes in by: a line of a request file (read
before the model loads) and the library's request (checked when the engine admits it) refuse the same
values in the same words, and accept the same values."""

from __future__ import annotations

import pytest

from bm.engine.requests.fields import RequestError, request_field
from bm.engine.requests.request import Request, RequestLimits
from bm.engine.requests.validate import validate_request
from bm.workloads.jsonl import parse_request
from bm.workloads.request import Row

LIMITS = RequestLimits(vocab_size=1000, max_seq_len=512, max_num_tokens=None, max_beam_width=4)

REFUSED = [
    ("temperature", -0.5),
    ("runtime_top_p", 0.0),
    ("runtime_top_p", 1.5),
    ("repetition_penalty", 0.0),
    ("runtime_top_k", -1),
    ("early_stopping", -1),
    ("pad_id", -3),
    ("random_seed", -1),
    ("min_length", -2),
    ("runtime_top_k", 1.9),
    ("temperature", True),
    ("return_log_probs", 1),
    ("num_return_sequences", 129),
    ("top_logprobs", 21),
    ("logit_bias", {"5": 200}),
]


def file_error(name: str, value: object) -> str:
    with pytest.raises(RequestError) as caught:
        parse_request({"input_ids": [1, 2], name: value}, Row.at_line(1))
    return str(caught.value)


def library_error(name: str, value: object) -> str:
    if name == "logit_bias":  # the library's dict has int keys where JSON has strings
        value = {int(k): v for k, v in value.items()}
    with pytest.raises(RequestError) as caught:
        validate_request(Request(0, [1, 2], 4, **{name: value}), LIMITS)
    return str(caught.value)


@pytest.mark.parametrize(("name", "value"), REFUSED)
def test_a_bad_value_is_refused_in_the_same_words_by_a_file_line_and_the_library(name, value):
    assert file_error(name, value) == library_error(name, value)


@pytest.mark.parametrize(
    ("name", "value"),
    [("temperature", 0.0), ("runtime_top_p", 1.0), ("early_stopping", 0), ("pad_id", 0), ("min_length", 4)],
)
def test_a_value_a_file_line_accepts_the_engine_accepts(name, value):
    checked = request_field(name, name, value)
    validate_request(Request(0, [1, 2], 4, **{name: checked}), LIMITS)


def test_the_engine_narrows_the_table_by_the_model_only():
    # The table allows any beam width; the engine built for 4 beams refuses 5, in the table's words.
    assert request_field("beam_width", "beam_width", 5) == 5
    message = library_error("beam_width", 5)
    assert message.startswith("beam_width: must be at most 4, got 5; ")
    assert "engine.max_beam_width" in message  # the bound is the engine's: the message names its knob
