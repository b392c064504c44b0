"""OpenAI batch bodies read as OpenAI and vLLM read them, on the embedded tiny model (byte tokenizer: token
t is byte t - 3, the end token is 2): no output cap a body does not ask for, and vLLM's sampling
extensions mapped onto bm's request fields."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from bm.cli.main import app

runner = CliRunner()
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
END = "2"  # the byte tokenizer's end token, as a logit_bias key


def completion(custom_id: str, **body) -> dict:
    body = {"prompt": "Once upon a time", **body}
    return {"custom_id": custom_id, "method": "POST", "url": COMPLETIONS, "body": body}


def run_lines(tmp_path, lines: list[dict], *flags: str):
    """``bm run`` over the batch ``lines``: the output lines by custom_id, and the CLI result."""
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out"
    args = ["run", str(batch), "-o", str(out), "-q", "--set", "model.device=cpu", *flags]
    result = runner.invoke(app, args)
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
        completion("greedy", max_tokens=8),
        completion("top-k-1", max_tokens=8, temperature=1.0, seed=3, top_k=1),
        completion("penalty", max_tokens=8, repetition_penalty=1.3),
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
