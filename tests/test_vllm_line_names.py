"""bm's own JSONL lines take vLLM's SamplingParams names, each meaning what it means to bm.LLM, and an
unknown field's "did you mean" comes from one table (bm.engine.requests.fields), never a near spelling of an
unrelated field. Plain Python: no model."""

from __future__ import annotations

import pytest

from bm.engine.requests.fields import FIELD_SYNONYMS, VLLM_SAMPLING_FIELDS
from bm.llm_params import SAMPLING_FIELDS
from bm.workloads.jsonl import KNOWN_KEYS, parse_request
from bm.workloads.request import Row, RowError


def parsed(**line) -> Row:
    row = Row.at_line(1)
    parse_request({"input_ids": [5, 6], **line}, row)
    return row


def refusal(**line) -> str:
    with pytest.raises(RowError) as caught:
        parsed(**line)
    return str(caught.value)


def test_the_vllm_names_table_is_the_libraries_and_every_name_is_a_field_of_a_line():
    assert VLLM_SAMPLING_FIELDS == SAMPLING_FIELDS
    assert set(VLLM_SAMPLING_FIELDS) <= KNOWN_KEYS


def test_vllm_sampling_names_on_a_bm_line_set_the_engine_fields_samplingparams_sets():
    row = parsed(
        min_tokens=3, stop_token_ids=[7, 9], ignore_eos=True, top_k=5, repetition_penalty=1.1,
        max_tokens=4, n=2, seed=1, logprobs=2, bad_words=["no"], min_p=0.1,
    )  # fmt: skip
    assert row.max_tokens == 4
    assert row.fields == {
        "min_length": 3,
        "stop_words_list": [[7], [9]],
        "end_id": -1,
        "runtime_top_k": 5,
        "repetition_penalty": 1.1,
        "num_return_sequences": 2,
        "random_seed": 1,
        "return_log_probs": True,
        "top_logprobs": 2,
        "bad_words_list": ["no"],
        "min_p": 0.1,
    }
    assert parsed(stop_token_ids=[7], stop_words_list=[[3, 4]]).fields["stop_words_list"] == [[3, 4], [7]]
    assert parsed(structured_outputs={"choice": ["yes", "no"]}).fields["guided_decoding"].kind == "choice"
    assert parsed(best_of=2, n=2).fields["num_return_sequences"] == 2
    assert "end_id" not in parsed(ignore_eos=False).fields


@pytest.mark.parametrize(
    ("line", "named"),
    [
        ({"prompt_logprobs": 1}, "prompt_logprobs: bm run records no prompt log probs"),
        ({"best_of": 3}, "best_of: 3 differs from n (1)"),
        ({"skip_special_tokens": False}, "skip_special_tokens"),
        ({"ignore_eos": True, "end_id": 5}, "ignore_eos: given with end_id"),
        ({"ignore_eos": "yes"}, "ignore_eos: expected true or false"),
        ({"stop_token_ids": [1.5]}, "stop_token_ids: expected a list of token ids"),
        ({"logprobs": 21}, "logprobs: must be at most 20"),
        ({"structured_outputs": {"nope": 1}}, "structured_outputs"),
    ],
)
def test_a_vllm_name_bm_run_cannot_honour_as_given_is_refused_naming_it(line, named):
    assert named in refusal(**line)


@pytest.mark.parametrize(
    ("typed", "suggested"),
    [
        ("prompt_token_ids", "'input_ids'"),  # not output_tokens, a near spelling
        ("max_completion_tokens", "'max_tokens'"),
        ("min_new_tokens", "'min_tokens'"),
        ("num_beams", "'beam_width'"),
        ("min_token", "'min_tokens'"),  # a typo still gets the nearest spelling
        ("stop_token_id", "'stop_token_ids'"),
    ],
)
def test_an_unknown_fields_suggestion_comes_from_the_one_table_then_the_nearest_spelling(typed, suggested):
    message = refusal(**{typed: 1})
    assert message.startswith(f"unknown field {typed!r}; did you mean {suggested}?"), message


def test_every_synonym_names_a_field_a_line_takes():
    assert set(FIELD_SYNONYMS.values()) <= KNOWN_KEYS
    assert not set(FIELD_SYNONYMS) & KNOWN_KEYS
