"""One name per concept: users write vLLM's names, the engine speaks the seed's, and the one table in
bm.engine.requests.fields translates both ways, for every front door that speaks back to a user."""

from __future__ import annotations

from bm.engine.requests.fields import USER_NAMES, VLLM_SAMPLING_FIELDS, in_user_terms
from bm.llm_params import user_message
from bm.runfiles.openai_batch_output import error_param
from bm.runfiles.records import in_line_terms
from bm.workloads.request import Row


def test_every_engine_name_said_back_is_a_user_name_that_sets_that_field():
    for engine, user in USER_NAMES.items():
        if engine == "return_log_probs":  # set by logprobs with top_logprobs, named back as logprobs
            assert VLLM_SAMPLING_FIELDS[user] == "top_logprobs"
            continue
        assert VLLM_SAMPLING_FIELDS[user] == engine, (engine, user)
    assert {USER_NAMES[f] for f in ("request_output_len", "runtime_top_k", "random_seed")} == {
        "max_tokens",
        "top_k",
        "seed",
    }
    assert USER_NAMES["num_return_sequences"] == "n" and USER_NAMES["stop_words_list"] == "stop"


def test_fields_set_by_names_of_different_meanings_keep_the_engine_name():
    # end_id is set by ignore_eos (a bool) and by a line's end_id (a token): neither name fits both
    assert "end_id" not in USER_NAMES and "guided_decoding" not in USER_NAMES
    assert in_user_terms("end_id: 900 is outside the vocabulary") == "end_id: 900 is outside the vocabulary"


def test_whole_words_only_are_translated():
    assert in_user_terms("runtime_top_k: 0..2147483647") == "top_k: 0..2147483647"
    # a longer identifier that contains an engine name is left alone
    assert in_user_terms("my_random_seed_x stays") == "my_random_seed_x stays"


def test_bm_llm_an_openai_error_and_a_line_name_the_output_length_as_the_user_did():
    message = "request_output_len: prompt (9) + output (4) tokens exceed the maximum sequence length 12"
    assert user_message(message).startswith("max_tokens: prompt (9)")
    assert error_param(f"line 3: {message}") == "max_tokens"
    row = Row.at_line(3, max_tokens=4, max_tokens_key="max_new_tokens")
    assert in_line_terms(message, row).startswith("max_new_tokens: prompt (9)")
    assert in_line_terms(message, Row.at_line(3)).startswith("--max-tokens: prompt (9)")
