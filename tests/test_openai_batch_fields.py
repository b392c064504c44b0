"""OpenAI batch bodies read as OpenAI and vLLM read them, on the embedded tiny model (byte tokenizer: token
t is byte t - 3, the end token is 2): no output cap a body does not ask for, and vLLM's sampling
extensions mapped onto bm's request fields."""

from __future__ import annotations

import json

from tests.batch_cli import invoke_batch

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
END = "2"  # the byte tokenizer's end token, as a logit_bias key


def completion(custom_id: str, **body) -> dict:
    body = {"prompt": "Once upon a time", **body}
    return {"custom_id": custom_id, "method": "POST", "url": COMPLETIONS, "body": body}


def run_lines(tmp_path, lines: list[dict], *flags: str):
    """``bm run`` over the batch ``lines``: the output lines by custom_id, and the CLI result."""
    result, out = invoke_batch(tmp_path, lines, *flags)
    assert result.exit_code == 0, result.output
    lines_out = [json.loads(x) for x in (out / "batch_output.jsonl").read_text().splitlines()]
    return {line["custom_id"]: line for line in lines_out}, result


def body_of(line: dict) -> dict:
    assert line["response"]["status_code"] == 200, line
    return line["response"]["body"]


def test_a_body_without_max_tokens_runs_to_the_end_token_or_the_length_limit_not_the_runs_default(tmp_path):
    lines = [
        completion("no-end", logit_bias={END: -100}),  # never ends by itself: the length limit ends it
        completion("ends", logit_bias={END: 100}),  # the end token at once
        completion("capped", max_tokens=3, logit_bias={END: -100}),
    ]
    got, _ = run_lines(tmp_path, lines, "--max-tokens", "4", "--set", "engine.max_seq_len=48")
    no_end = body_of(got["no-end"])
    assert no_end["usage"]["total_tokens"] == 48  # not --max-tokens 4
    assert no_end["choices"][0]["finish_reason"] == "length"
    ends = body_of(got["ends"])
    assert ends["usage"]["completion_tokens"] == 1 and ends["choices"][0]["finish_reason"] == "stop"
    capped = body_of(got["capped"])
    assert capped["usage"]["completion_tokens"] == 3 and capped["choices"][0]["finish_reason"] == "length"


def test_vllm_sampling_extensions_in_a_body_set_bm_fields(tmp_path):
    lines = [
        completion("ends", max_tokens=6, logit_bias={END: 100}),
        completion("ignore-eos", max_tokens=6, logit_bias={END: 100}, ignore_eos=True),
        completion("min-tokens", max_tokens=9, logit_bias={END: 100}, min_tokens=5),
        completion("greedy", max_tokens=8, temperature=0),
        completion("top-k-1", max_tokens=8, temperature=1.0, seed=3, top_k=1),
        completion("penalty", max_tokens=8, repetition_penalty=1.3, temperature=0),
    ]
    got, _ = run_lines(tmp_path, lines)
    assert body_of(got["ends"])["usage"]["completion_tokens"] == 1
    ignore = body_of(got["ignore-eos"])
    assert ignore["usage"]["completion_tokens"] == 6 and ignore["choices"][0]["finish_reason"] == "length"
    held = body_of(got["min-tokens"])  # the end token is held back for 5 tokens, then comes
    assert held["usage"]["completion_tokens"] == 6 and held["choices"][0]["finish_reason"] == "stop"
    assert body_of(got["top-k-1"])["choices"][0]["text"] == body_of(got["greedy"])["choices"][0]["text"]
    assert body_of(got["penalty"])["usage"]["completion_tokens"] == 8


def test_unknown_body_fields_are_ignored_with_one_warning_per_name_and_unhonourable_ones_refused(tmp_path):
    lines = [
        completion("a", max_tokens=2, reasoning_effort="low", verbosity="low"),
        completion("b", max_tokens=2, reasoning_effort="high", prediction={"type": "content"}),
        completion("echo-off", max_tokens=2, echo=False, best_of=1),
        completion("echo", max_tokens=2, echo=True),
        completion("suffix", max_tokens=2, suffix="The end."),
        completion("best-of", max_tokens=2, best_of=3),
        {"custom_id": "chat-only", "method": "POST", "url": COMPLETIONS,
         "body": {"prompt": "x", "max_completion_tokens": 2}},
    ]  # fmt: skip
    got, result = run_lines(tmp_path, lines)
    for custom_id in ("a", "b", "echo-off"):
        body_of(got[custom_id])
    for custom_id, field in (("echo", "echo"), ("suffix", "suffix"), ("best-of", "best_of")):
        error = got[custom_id]["response"]["body"]["error"]
        assert got[custom_id]["response"]["status_code"] == 400 and error["param"] == field, error
    assert got["chat-only"]["response"]["body"]["error"]["param"] == "max_completion_tokens"
    said = " ".join(result.stderr.split())
    assert said.count("body.reasoning_effort") == 1
    assert said.count("body.verbosity") == 1 and said.count("body.prediction") == 1


def test_a_completions_prompt_list_gets_one_response_with_a_choice_per_prompt_and_sample(tmp_path):
    from openai.types import Completion

    ids = [3 + b for b in b"The end"]  # the byte tokenizer's ids of "The end"
    lines = [
        completion("one", prompt="Once upon", max_tokens=4, temperature=0),
        completion("two", prompt="The end", max_tokens=4, temperature=0),
        completion("texts", prompt=["Once upon", "The end"], max_tokens=4, n=2, temperature=0),
        completion("id-lists", prompt=[ids, ids], max_tokens=4, temperature=0),
        completion("ids", prompt=ids, max_tokens=4, temperature=0),
        completion("mixed", prompt=["x", [5]], max_tokens=4),
    ]
    got, _ = run_lines(tmp_path, lines)
    one, two = (body_of(got[k])["choices"][0]["text"] for k in ("one", "two"))
    texts = Completion.model_validate(body_of(got["texts"]))
    assert [c.index for c in texts.choices] == [0, 1, 2, 3]  # prompt x n + sample, as OpenAI numbers them
    assert [c.text for c in texts.choices] == [one, one, two, two]  # greedy: n samples agree
    singles = [body_of(got[k])["usage"] for k in ("one", "two")]
    assert texts.usage.prompt_tokens == sum(u["prompt_tokens"] for u in singles)
    assert texts.usage.completion_tokens == 2 * sum(u["completion_tokens"] for u in singles)
    assert [c.text for c in Completion.model_validate(body_of(got["id-lists"])).choices] == [two, two]
    assert [c.text for c in Completion.model_validate(body_of(got["ids"])).choices] == [two]
    assert got["mixed"]["response"]["status_code"] == 400
    assert "not a mix" in got["mixed"]["response"]["body"]["error"]["message"]


def test_a_prompt_lists_line_ends_cancelled_or_failed_as_a_whole_when_one_prompt_does():
    from bm.runfiles.records import LineParts
    from bm.workloads.request import Row

    def part(p: int) -> Row:
        return Row(where="line 1", index=0, part=p, num_parts=2)

    ok = {"index": 0, "finish_reason": "length", "text": "a", "output_ids": [5], "num_output_tokens": 1}
    cancelled = {"index": 0, "finish_reason": "cancelled", "output_ids": [], "num_output_tokens": 0}
    parts = LineParts()
    assert parts.add(part(1), cancelled) is None  # held until the line's other prompt ends
    assert parts.add(part(0), ok)["finish_reason"] == "cancelled"  # a resume runs the whole line again
    parts = LineParts()
    parts.add(part(0), ok)
    joined = parts.add(part(1), {**ok, "text": "b", "num_prompt_tokens": 3})
    assert [(s["index"], s["prompt_index"], s["text"]) for s in joined["samples"]] == [
        (0, 0, "a"),
        (1, 1, "b"),
    ]
    assert joined["num_output_tokens"] == 2 and joined["num_prompt_tokens"] == 3
