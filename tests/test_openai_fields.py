"""OpenAI batch lines with n, top log probs, logit bias and the fields that change nothing computed, on
the embedded tiny model (byte tokenizer: token t is byte t - 3, the end token is 2); every output body
parses with the ``openai`` package's own types."""

from __future__ import annotations

import json

import pytest

from tests.test_cli_chat_batch import run_batch_file

openai_types = pytest.importorskip("openai.types")
from openai.types.chat import ChatCompletion  # noqa: E402

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def chat(custom_id: str, **body) -> dict:
    body = {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 8, **body}
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body}


def completion(custom_id: str, **body) -> dict:
    body = {"prompt": "Once upon a time", "max_tokens": 8, **body}
    return {"custom_id": custom_id, "method": "POST", "url": COMPLETIONS, "body": body}


def run_batch(tmp_path, lines: list[dict]) -> dict[str, dict]:
    """``bm run`` over the lines; the output lines by custom_id."""
    return run_batch_file(tmp_path, lines)[0]


def body_of(line: dict) -> dict:
    assert line["response"]["status_code"] == 200, line
    return line["response"]["body"]


def test_n_choices_are_indexed_distinct_at_temperature_one_and_parse_as_openai_types(tmp_path):
    out = run_batch(
        tmp_path,
        [
            chat("chat", n=4, temperature=1.0, seed=5),
            completion("cmpl", n=3, temperature=1.0, seed=5),
            chat("greedy", n=3, temperature=0),
        ],
    )
    parsed = ChatCompletion.model_validate(body_of(out["chat"]))
    assert [c.index for c in parsed.choices] == [0, 1, 2, 3]
    assert len({c.message.content for c in parsed.choices}) == 4
    completions = openai_types.Completion.model_validate(body_of(out["cmpl"]))
    assert [c.index for c in completions.choices] == [0, 1, 2]
    assert len({c.text for c in completions.choices}) == 3
    greedy = ChatCompletion.model_validate(body_of(out["greedy"]))
    assert len({c.message.content for c in greedy.choices}) == 1
    # usage counts every choice's tokens
    records = [json.loads(x) for x in (tmp_path / "out" / "outputs.jsonl").read_text().splitlines()]
    chat_record = next(r for r in records if r["id"] == "chat")
    assert parsed.usage.completion_tokens == sum(s["num_output_tokens"] for s in chat_record["samples"])


def test_top_logprobs_have_openais_shape_sorted_with_the_chosen_token(tmp_path):
    out = run_batch(
        tmp_path,
        [
            chat("chat", logprobs=True, top_logprobs=5, n=2, temperature=0),
            completion("cmpl", logprobs=3, temperature=0),
        ],
    )
    parsed = ChatCompletion.model_validate(body_of(out["chat"]))
    for choice in parsed.choices:
        assert choice.logprobs.content
        for entry in choice.logprobs.content:
            values = [t.logprob for t in entry.top_logprobs]
            assert len(values) == 5 and values == sorted(values, reverse=True)
            assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the top one
            assert entry.top_logprobs[0].logprob == entry.logprob
            assert all(t.bytes == list(t.token.encode("utf-8")) for t in entry.top_logprobs)
    cmpl = openai_types.Completion.model_validate(body_of(out["cmpl"]))
    logprobs = cmpl.choices[0].logprobs
    assert len(logprobs.top_logprobs) == len(logprobs.tokens)
    for token, value, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert len(top) <= 3
        # OpenAI's legacy shape maps token text to log prob: a byte-level tokenizer's partial UTF-8
        # bytes all render as U+FFFD, so such an entry names one of several tokens; check the others
        if token != "\ufffd":
            assert top[token] == value


def test_fields_that_change_nothing_are_accepted_and_change_nothing(tmp_path):
    extra = {"store": False, "stream": False, "stream_options": {"include_usage": True}}
    extra |= {"service_tier": "auto", "parallel_tool_calls": True, "metadata": {"k": "v"}}
    greedy = {"temperature": 0}  # OpenAI lines sample by default: equal answers need greedy ones
    lines = [chat("plain", **greedy), chat("extra", **extra, **greedy), completion("cmpl", store=True)]
    out = run_batch(tmp_path, lines)
    plain, with_extra = body_of(out["plain"]), body_of(out["extra"])
    assert with_extra["choices"] == plain["choices"]
    ChatCompletion.model_validate(with_extra)
    openai_types.Completion.model_validate(body_of(out["cmpl"]))


def test_logit_bias_steers_the_output_and_no_logprob_entry_is_left_for_the_end_token(tmp_path):
    out = run_batch(
        tmp_path,
        [
            chat("end", logprobs=True, logit_bias={"2": 100}),  # the end token first: nothing else
            chat("bytes", logprobs=True, max_tokens=4, logit_bias={str(3 + ord("z")): 100}),
        ],
    )
    ended = ChatCompletion.model_validate(body_of(out["end"]))
    assert ended.choices[0].finish_reason == "stop" and ended.choices[0].message.content == ""
    assert ended.choices[0].logprobs.content == []  # no entry for the end token
    biased = ChatCompletion.model_validate(body_of(out["bytes"]))
    assert biased.choices[0].message.content == "zzzz"
    assert [c.token for c in biased.choices[0].logprobs.content] == ["z"] * 4


@pytest.mark.parametrize(
    "line, param",
    [
        (chat("a", n=200), "n"),
        (chat("a", n=0), "n"),
        (chat("a", logprobs=True, top_logprobs=21), "top_logprobs"),
        (chat("a", top_logprobs=2), "top_logprobs"),
        (chat("a", logit_bias={"5": 200}), "logit_bias[5]"),
        (chat("a", logit_bias={"x": 1}), "logit_bias"),
        (chat("a", store="no"), "store"),
        (chat("a", stream_options=3), "stream_options"),
        (chat("a", seed=-1), "seed"),
        (completion("a", logprobs=6), "logprobs"),
        (completion("a", max_tokens=2.5), "max_tokens"),
    ],
)
def test_an_errors_param_names_the_field(tmp_path, line, param):
    out = run_batch(tmp_path, [line, chat("ok")])["a"]  # one line runs, so the run succeeds
    assert out["response"]["status_code"] == 400
    error = out["response"]["body"]["error"]
    assert error["param"] == param, error
